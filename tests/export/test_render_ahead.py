"""Rendering ahead of the scrape: a render cache renders a block once for concurrent callers,
the thread renders after a change (and only then), and a scrape after it is as fresh, and
the same bytes, as one from caches never rendered ahead."""

from __future__ import annotations

import threading
import time

import pytest

from gpumon.agent.views import RENDER_AHEAD_WITHIN_S, RENDER_LEAD_S, AgentCollector
from gpumon.collectors.samples import GpuStatic, SenderCredentials
from gpumon.export.exposition import GaugeFamily, RenderCache, render
from gpumon.export.render_ahead import RenderAhead
from gpumon.state.node import NodeState, NvmlStatus
from gpumon.state.owners import OwnerState
from gpumon.state.ranks import RankStore
from gpumon.wire import StepRecord
from tests.helpers import wait_for

GPU = GpuStatic(index=0, uuid="GPU-a", name="NVIDIA H100 80GB HBM3", pci_bus_id="0000:01:00.0")


def _gauge() -> list[GaugeFamily]:
    return [GaugeFamily("g", "A gauge.", labels=["rank"])]


def test_concurrent_callers_render_a_block_once() -> None:
    filling = threading.Event()
    release = threading.Event()
    fills: list[int] = []

    def fill(families: list[GaugeFamily], source: int) -> None:
        fills.append(source)
        filling.set()
        release.wait(10.0)
        families[0].add_metric(["0"], float(source))

    cache = RenderCache(_gauge, fill)
    results: list[str] = []
    first = threading.Thread(target=lambda: results.append(cache.families([("r", 1, 7)])[0].text))
    first.start()
    assert filling.wait(10.0)
    second = threading.Thread(target=lambda: results.append(cache.families([("r", 1, 7)])[0].text))
    second.start()
    time.sleep(0.05)  # the second caller is now waiting on the first one's block
    release.set()
    first.join(10.0)
    second.join(10.0)
    assert fills == [7]  # rendered by the first caller only, reused by the second
    assert results == ['g{rank="0"} 7.0\n'] * 2


def test_renders_after_a_change_and_never_without_one() -> None:
    calls: list[float] = []
    ahead = RenderAhead(lambda: calls.append(time.monotonic()), min_gap_s=0.0, quiet_s=0.0)
    ahead.start()
    try:
        time.sleep(0.05)
        assert calls == [] and ahead.passes_total == 0
        ahead.changed()
        wait_for(lambda: ahead.passes_total == 1, what="a pass after the change")
        ahead.changed()
        wait_for(lambda: ahead.passes_total == 2, what="a pass after the second change")
    finally:
        ahead.stop()
    assert len(calls) == 2


def test_a_failing_pass_keeps_the_thread_and_stop_ends_it() -> None:
    def fail() -> None:
        raise RuntimeError("a broken family")

    ahead = RenderAhead(fail, min_gap_s=0.0, quiet_s=0.0)
    ahead.start()
    ahead.changed()
    wait_for(lambda: ahead.passes_total == 1, what="the failed pass counted")
    ahead.changed()
    wait_for(lambda: ahead.passes_total == 2, what="a pass after the failed one")
    ahead.stop()
    assert not ahead._thread.is_alive()


def _agent_view() -> tuple[RankStore, AgentCollector]:
    node = NodeState()
    node.set_nvml(NvmlStatus(up=True), [GPU])
    store = RankStore()
    view = AgentCollector(node, store, lambda: None, lambda: None, OwnerState("node"))
    return store, view


def _step(store: RankStore, step: int) -> None:
    store.ingest([StepRecord(run="r", rank=rank, step=step, duration_s=0.5, t_start=100.0 + step)
                  for rank in range(4)], SenderCredentials(pid=42), monotonic=1.0, now_t=101.0)


def _ranks_part(body: bytes) -> list[str]:
    """The scrape's lines, less the agent's own process families."""
    return [line for line in body.decode().splitlines()
            if line.startswith(("gpumon_steps_total", "gpumon_step_last"))]


def test_a_scrape_after_rendering_ahead_is_fresh_and_renders_no_block_again() -> None:
    store, view = _agent_view()
    render(view.collect())  # the agent is scraped
    _step(store, 1)
    view.render_ranks()
    _step(store, 2)  # a step after the pass: the scrape must show it, not the pass's block
    after_change = render(view.collect())
    assert 'gpumon_steps_total{rank="0",run="r"} 2.0' in after_change.decode()
    view.render_ranks()  # as the thread would after that step: nothing moved since
    fills: list[object] = []
    for cache in vars(view._step_families).values():
        fill = cache._fill
        cache._fill = lambda families, source, fill=fill: (fills.append(source),
                                                           fill(families, source))
    again = render(view.collect())
    assert fills == []  # every block was ready
    fresh_store, fresh_view = _agent_view()
    _step(fresh_store, 1)
    _step(fresh_store, 2)
    assert _ranks_part(again) == _ranks_part(render(fresh_view.collect()))
    assert _ranks_part(again) == _ranks_part(after_change)


def test_rendering_ahead_without_ranks_makes_nothing() -> None:
    _, view = _agent_view()
    render(view.collect())
    view.render_ranks()
    assert view._step_families.runs_held() == (0, 0)


def test_an_agent_not_scraped_lately_renders_nothing_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store, view = _agent_view()
    _step(store, 1)
    view.render_ranks()  # never scraped
    assert view._step_families.runs_held() == (0, 0)
    render(view.collect())
    _step(store, 2)
    later = time.monotonic() + RENDER_AHEAD_WITHIN_S + 1.0
    monkeypatch.setattr(time, "monotonic", lambda: later)
    view.render_ranks()  # the scraper went away
    monkeypatch.undo()
    assert view._step_families.runs_held() == (1, 0)
    held = {key: block[0] for key, block in view._step_families._steps._blocks.items()}
    view.render_ranks()  # scraped recently: the step after the scrape is rendered
    assert {key: block[0] for key, block in view._step_families._steps._blocks.items()} != held


def test_a_pass_waits_for_the_scrape_expected_next_and_stop_cuts_the_wait_short() -> None:
    calls: list[float] = []
    ahead = RenderAhead(lambda: calls.append(time.monotonic()), min_gap_s=0.0, quiet_s=0.0,
                        wait_s=lambda: 3600.0)
    ahead.start()
    ahead.changed()
    time.sleep(0.2)
    assert calls == []  # waiting for the scrape an hour away, not rendering after the change
    ahead.stop()
    assert not ahead._thread.is_alive() and calls == []


def test_the_wait_aims_just_before_the_scrape_expected_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, view = _agent_view()
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    assert view.render_wait_s() == 0.0  # never scraped: no pacing
    render(view.collect())
    assert view.render_wait_s() == 0.0  # one scrape: no interval known yet
    clock[0] = 1015.0
    render(view.collect())  # a scraper every 15 s
    clock[0] = 1015.5
    assert view.render_wait_s() == pytest.approx(15.0 - RENDER_LEAD_S - 0.5)
    clock[0] = 1029.9  # within the lead: at once
    assert view.render_wait_s() == 0.0
    clock[0] = 1031.0  # the scrape is late (or was missed): aim at the one after it
    assert view.render_wait_s() == pytest.approx(1045.0 - RENDER_LEAD_S - 1031.0)
    for _ in range(2):  # scraped back to back: every change is rendered at once
        clock[0] += 0.003
        render(view.collect())
    clock[0] += 0.001
    assert view.render_wait_s() < 0.001
