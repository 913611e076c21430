"""The agent as a library on simulated GPUs: exposition, JSON views, moving counters."""

from __future__ import annotations

import gc
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumon.agent.config import AgentConfig
from gpumon.agent.lifecycle import Agent
from gpumon.collectors.samples import SenderCredentials
from gpumon.sim.gpus import SimulatedSource
from gpumon.state.gpu_history import Packed
from gpumon.wire import StepRecord
from tests.helpers import (
    http_get,
    library_agent,
    parse_metrics,
    require_tool,
    scrape_text,
    value,
    values,
    wait_for,
)


@pytest.fixture
def sim_agent(tmp_path: Path) -> Iterator[Agent]:
    with library_agent(tmp_path / "ingest.sock", simulate=2, interval=0.2) as agent:
        yield agent


scrape = scrape_text


def test_every_gpu_series_present_in_base_units(sim_agent: Agent) -> None:
    wait_for(lambda: "gpumon_gpu_power_watts" in scrape(sim_agent), what="first GPU sample")
    metrics = parse_metrics(scrape(sim_agent))
    for gpu in ("0", "1"):
        assert value(metrics, "gpumon_gpu_up", gpu=gpu) == 1
        assert 0 <= value(metrics, "gpumon_gpu_utilization_ratio", gpu=gpu) <= 1
        assert value(metrics, "gpumon_gpu_memory_total_bytes", gpu=gpu) == 80 * 1024**3
        assert 1e9 < value(metrics, "gpumon_gpu_sm_clock_hertz", gpu=gpu) < 3e9
        assert 50 < value(metrics, "gpumon_gpu_power_watts", gpu=gpu) <= 700
    assert value(metrics, "gpumon_nvml_up") == 1
    assert value(metrics, "gpumon_agent_info", version="0.1.0") == 1
    assert value(metrics, "gpumon_host_memory_total_bytes") > 0
    assert len(values(metrics, "gpumon_gpu_info")) == 2


def test_counters_move(sim_agent: Agent) -> None:
    wait_for(lambda: "gpumon_gpu_nvlink_transmit_bytes_total" in scrape(sim_agent))
    first = value(parse_metrics(scrape(sim_agent)), "gpumon_gpu_nvlink_transmit_bytes_total",
                  gpu="0")
    time.sleep(0.6)
    second = value(parse_metrics(scrape(sim_agent)), "gpumon_gpu_nvlink_transmit_bytes_total",
                   gpu="0")
    assert second > first


def test_promtool_check_metrics_is_clean(sim_agent: Agent) -> None:
    promtool = require_tool("promtool")
    wait_for(lambda: "gpumon_gpu_power_watts" in scrape(sim_agent))
    result = subprocess.run([promtool, "check", "metrics"], input=scrape(sim_agent),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


def test_json_views(sim_agent: Agent) -> None:
    url = f"http://127.0.0.1:{sim_agent.port}"
    wait_for(lambda: http_get(url + "/readyz")[0] == 200, what="readiness")
    status, body = http_get(url + "/readyz")
    assert json.loads(body) == {"status": "ok", "problems": []}
    status, body = http_get(url + "/api/v1/snapshot")
    snapshot = json.loads(body)
    assert status == 200
    assert [g["index"] for g in snapshot["gpus"]] == [0, 1]
    assert snapshot["nvml"]["simulated"] is True
    assert http_get(url + "/healthz") == (200, b"ok\n")
    assert http_get(url + "/nope")[0] == 404


class _ScrapeBetweenHolds:
    """The analyzer lock, with a scrape on another thread each time housekeeping lets go."""

    def __init__(self, agent: Agent) -> None:
        self._lock = threading.Lock()
        self._agent = agent
        self.holds = 0
        self.scrapes = 0

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()
        if threading.current_thread() is threading.main_thread():
            self.holds += 1
            scrape = threading.Thread(target=self._scrape)
            scrape.start()
            scrape.join(5.0)

    def _scrape(self) -> None:
        list(self._agent.families())
        self.scrapes += 1


def _agent_with_gpu_samples() -> tuple[Agent, float]:
    """An agent of 8 simulated GPUs with 10 s of their samples, and the time now."""
    agent = Agent(AgentConfig(simulate=8, collectors=()))
    source = SimulatedSource(8)
    agent.state.set_nvml(agent.state.nvml, source.statics())
    now = time.time()
    for k in range(20):
        agent.state.put_gpu_samples(source.sample(now - 10 + k * 0.5, k * 0.5))
    return agent, now


def test_housekeeping_analyses_64_ranks_in_slices_letting_scrapes_in_between() -> None:
    agent, now = _agent_with_gpu_samples()
    agent.take_records([StepRecord(run="llm", rank=rank, step=n, duration_s=0.5,
                                  t_start=now - 6 + n * 0.5, gpu=rank % 8,
                                  phases_s={"forward": 0.2, "backward": 0.25})
                       for n in range(4) for rank in range(64)], SenderCredentials())
    probe = agent.analyzer._lock = _ScrapeBetweenHolds(agent)  # type: ignore[assignment]
    agent._housekeeping(now, time.monotonic())
    assert probe.holds >= 1 + 64 * 2 // 8  # forget, then at most 8 verdicts a slice
    assert probe.scrapes == probe.holds
    analyses = agent.analyzer.analyses()
    assert len(analyses) == 64
    assert all(a.verdict is not None and sum(a.bottleneck_steps.values()) == 4 for a in analyses)
    assert {a.straggler_score for a in analyses} == {1.0}


def test_housekeeping_on_a_node_without_ranks_makes_no_analysis_pass() -> None:
    agent, now = _agent_with_gpu_samples()
    copies = []
    history = agent.state.gpu_history

    def counted() -> dict[int, tuple[Packed, ...]]:
        copies.append(1)
        return history()

    agent.state.gpu_history = counted  # type: ignore[method-assign]
    agent._housekeeping(now, time.monotonic())
    assert copies == [] and not agent.analyzer.has_ranks()
    agent.take_records([StepRecord(run="llm", rank=0, step=0, duration_s=0.5, t_start=now - 6,
                                   gpu=0)], SenderCredentials())
    agent._housekeeping(now, time.monotonic())
    assert copies == [1] and len(agent.analyzer.analyses()) == 1


def test_what_exists_at_start_is_frozen_until_stop(tmp_path: Path) -> None:
    with library_agent(tmp_path / "ingest.sock", simulate=1):
        assert gc.get_freeze_count() > 10_000  # the imported modules at least
    assert gc.get_freeze_count() == 0


def _sleeps(thread: threading.Thread) -> int:
    """How often a thread has blocked so far (each wakeup ends one)."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])


def test_idle_server_and_receiver_sleep_until_work_or_stop(tmp_path: Path) -> None:
    with library_agent(tmp_path / "ingest.sock", simulate=1, interval=5.0) as agent:
        idle = [t for t in threading.enumerate() if t.name in ("gpumon-http", "gpumon-ingest-recv")]
        assert len(idle) == 2
        time.sleep(0.3)
        before = [_sleeps(t) for t in idle]
        time.sleep(1.5)  # the old poll loops woke 4-5 times a second each
        assert [_sleeps(t) - b for t, b in zip(idle, before, strict=True)] == [0, 0]
        assert http_get(f"http://127.0.0.1:{agent.port}/healthz") == (200, b"ok\n")
        started = time.monotonic()
        agent.stop()
        assert time.monotonic() - started < 0.5
        assert not any(t.is_alive() for t in idle)
