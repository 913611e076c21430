"""`gpumon report --prometheus`: a real Prometheus and a real VictoriaMetrics scrape a real agent
(simulated GPUs) that a run of three ranks reports to, rank 2 doing more work than its peers;
the page made from either's range queries shows that run, its straggler and every figure, in
Chromium. Beside it a pipeline of two stages (``pipeline.py``) reports too: its page names
each rank's layout, own work and bubble, and its slowest stage."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpumon.analysis.goodput import CAUSES
from gpumon.report.page import render
from gpumon.report.prometheus import PrometheusSource, load_prometheus
from gpumon.testing.metrics import parse_metrics, value
from gpumon.testing.net import http_get
from gpumon.testing.pipeline import start_victoria_metrics
from gpumon.testing.recordings import Run, step_line
from tests.helpers import (
    ROOT,
    AgentProcess,
    PrometheusProcess,
    agent_env,
    start_agent,
    start_prometheus,
    wait_for,
)
from tests.report import pipeline
from tests.report.browser import open_page

pytestmark = pytest.mark.waits

RUN = Run(run="llm", ranks=3, step_s=0.2)


def _feed(agent: AgentProcess, stop: threading.Event) -> None:
    """Each step sent as it ends, stamped with the wall clock; the pipeline's too, after each
    rank's hello."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    run = replace(RUN, t0=time.time())
    rng = random.Random(1)
    for rank in range(pipeline.RANKS):
        sock.sendto(json.dumps(pipeline.hello(rank)).encode(), str(agent.socket_path))
    step = 0
    while not stop.is_set():
        stop.wait(max(0.0, run.t0 + (step + 1) * run.step_s - time.time()))
        for rank in range(run.ranks):
            sock.sendto(json.dumps(step_line(run, rank, step, rng)).encode(),
                        str(agent.socket_path))
        for rank in range(pipeline.RANKS):
            sock.sendto(json.dumps(pipeline.step(rank, step, run.t0, run.step_s)).encode(),
                        str(agent.socket_path))
        step += 1
    sock.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Prometheus and VictoriaMetrics, both scraping the agent every second, by name → URL
    (and the agent's own, as ``agent``)."""
    tmp = tmp_path_factory.mktemp("report-prometheus")
    agent = start_agent(tmp, "--simulate", "3", "--interval", "0.25")
    stop = threading.Event()
    feeder = threading.Thread(target=_feed, args=(agent, stop), daemon=True)
    feeder.start()
    server: PrometheusProcess | None = None
    victoria = None
    try:
        server = start_prometheus(tmp, [f"127.0.0.1:{agent.port}"], scrape_interval="1s")
        scrape = tmp / "vm-scrape.yml"
        scrape.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [
            {"job_name": "gpumon", "static_configs": [{"targets": [f"127.0.0.1:{agent.port}"]}]}]}))
        victoria = start_victoria_metrics(tmp, f"-promscrape.config={scrape}")
        # Flagged once its slowness has persisted over 24 steps; then a few more scrapes.
        wait_for(lambda: server.query('gpumon_step_flag{run="llm",flag="straggler"} == 1'),
                 timeout=60, what="the straggler in Prometheus")
        wait_for(lambda: victoria.query('gpumon_step_flag{run="llm",flag="straggler"} == 1'),
                 timeout=30, what="the straggler in VictoriaMetrics")
        time.sleep(4)
        yield {"prometheus": server.url, "victoria-metrics": victoria.url, "agent": agent.url}
    finally:
        stop.set()
        feeder.join(5)
        for service in (server, victoria):
            if service is not None:
                service.stop()
        agent.stop()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prometheus", "victoria-metrics"])
def test_a_report_from_prometheus_shows_the_run(servers: dict[str, str], name: str,
                                                tmp_path: Path) -> None:
    url = servers[name]
    model = load_prometheus(url, "llm", "2m", timeout_s=10)
    agent_steps = sum(float(r["value"][1]) for r in
                      PrometheusSource(url, 10).instant('gpumon_steps_total{run="llm"}'))
    assert model.ranks == [0, 1, 2]
    assert model.summary.stragglers == {2: "compute"}
    assert 0 < model.summary.steps <= agent_steps
    assert model.summary.walls and model.capacity_bytes == pytest.approx(80e9, rel=0.2)
    # The stacked phases add up to the step time the run reported (0.2 s, 1 % jitter).
    stacked = [sum(m.values()[i] or 0.0 for m in model.phases.values())
               for i in range(model.bins)]
    assert [round(v, 2) for v in stacked if v] and all(
        v == pytest.approx(0.2, rel=0.05) for v in stacked if v)

    # Where each rank's time went: the agent's counters as last scraped, so never past what
    # the agent counts now (its time only grows); the rank's startup (before its first step)
    # was settled before the first scrape, so it is the agent's; no restart.
    metrics = parse_metrics(http_get(servers["agent"] + "/metrics")[1].decode())
    assert sorted(model.time_totals) == [0, 1, 2]
    for rank, totals in model.time_totals.items():
        labels = {"run": "llm", "rank": str(rank)}
        now = {cause: value(metrics, "gpumon_badput_seconds_total", cause=cause, **labels)
               for cause in CAUSES}
        assert totals.badput_s["startup"] == pytest.approx(now["startup"], rel=1e-6)
        assert 0 < totals.wall_s <= (value(metrics, "gpumon_goodput_seconds_total", **labels)
                                     + value(metrics, "gpumon_unsaved_seconds", **labels)
                                     + sum(now.values()) + 1e-6), (rank, totals, now)
        assert totals.restarts == 0 and totals.restarted_at == ()

    page = tmp_path / "llm.html"
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "report", "--prometheus",
                             url, "--run", "llm", "--since", "2m", "-o", str(page)],
                            capture_output=True, text=True, env=agent_env(), cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    drawn = open_page(page, tmp_path)
    assert drawn["errors"] == []
    assert set(drawn["figures"]) == {"time-by-cause", "step-phases", "verdicts", "step-heatmap",
                                     "memory", "gpu-activity", "links", "comm"}
    assert all(f["svg"] and f["drawn"] for f in drawn["figures"].values())
    heatmap = drawn["figures"]["step-heatmap"]["data"][0]
    assert [y for y in heatmap["y"] if "straggler" in y] == ["rank 2 ⚠ straggler (compute)"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prometheus", "victoria-metrics"])
def test_a_report_from_prometheus_names_a_pipelines_stages(servers: dict[str, str], name: str,
                                                           tmp_path: Path) -> None:
    model = load_prometheus(servers[name], "gpt", "2m", timeout_s=10)
    assert {r: (layout.pp, layout.dp, layout.tp) for r, layout in model.layouts.items()} == {
        0: (0, 0, None), 1: (0, 1, None), 2: (1, 0, None), 3: (1, 1, None)}
    # 0.2 s steps: stage 0 works 0.08 s and waits 0.1 s of it to receive, stage 1 0.18 s
    assert model.own_work_s == pytest.approx({0: 0.08, 1: 0.08, 2: 0.18, 3: 0.18}, rel=0.05)
    assert model.bubble_share == pytest.approx({0: 0.5, 1: 0.5, 2: 0.075, 3: 0.075}, rel=0.05)
    assert sorted(model.bubble) == [0, 1, 2, 3]
    assert not model.summary.stragglers  # each stage is compared with its replica only
    rows = pipeline.table_rows(render(model))
    assert [row[:2] + row[-1:] for row in rows[1:]] == [
        ["rank 0", "pp0 dp0", ""], ["rank 1", "pp0 dp1", ""],
        ["rank 2", "pp1 dp0", "slowest stage"], ["rank 3", "pp1 dp1", "slowest stage"]]


@pytest.mark.slow
def test_an_unknown_run_in_prometheus_lists_the_runs(servers: dict[str, str]) -> None:
    url = servers["prometheus"]
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "report", "--prometheus",
                             url, "--run", "nope", "--since", "5m"],
                            capture_output=True, text=True, env=agent_env(), cwd=ROOT,
                            timeout=120)
    assert result.returncode == 1
    assert f"no run 'nope' in {url} over the last 5m; the runs there are: 'gpt', 'llm'" \
        in result.stderr
