"""Profiler traces of a real 2-rank DDP job (gloo, under torchrun and ``gpumon run``, no gpumon
in its code) asked of a real agent: automatically (the rule fires on a verdict) and on demand
(``gpumon trace --all-ranks --wait``). Holistic Trace Analysis loads every rank's trace; each
traced step's phase ranges, summed, agree with the phase seconds the agent recorded for that
step; the agent counts them, lists them and names the latest one per rank for the alerts."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from gpumon.testing import AgentProcess, free_port, http_get, series, start_agent, value, wait_for
from tests.e2e.distributed import Job
from tests.helpers import RECORDING, ROOT

JOBS = Path(__file__).resolve().parent / "jobs"
PHASE_BOUND_S = 0.0002
"""How far a traced step's summed phase ranges may be from the seconds the agent recorded for
it: the ranges are stamped one call away from the core's own clock readings (a few µs per
boundary) and rounded to a nanosecond."""

pytestmark = pytest.mark.slow


def _trace_events(path: Path) -> dict[str, Any]:
    with gzip.open(path) as f:
        document: dict[str, Any] = json.load(f)
    return document


def phase_sums(document: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per traced step (the step number gpumon recorded), the seconds of each gpumon phase
    range inside that step's ``gpumon.step`` range (``data`` lies before it, in its window)."""
    events = [e for e in document["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if str(e["name"]).startswith("gpumon.step ")]
    records = [e for e in events if e["name"] == "gpumon.record"]
    sums: dict[int, dict[str, float]] = {}
    for step in steps:
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        record = next(r for r in records if r["ts"] <= (t0 + t1) / 2 <= r["ts"] + r["dur"])
        window0, window1 = record["ts"], record["ts"] + record["dur"]
        phases: dict[str, float] = defaultdict(float)
        for e in events:
            if e.get("cat") == "gpumon" and "phase" in e.get("args", {}):
                if window0 - 1 <= e["ts"] and e["ts"] + e["dur"] <= window1 + 1:
                    phases[e["args"]["phase"]] += e["dur"] / 1e6
        sums[record["args"]["step"]] = dict(phases)
    return sums


def _api(agent: AgentProcess, path: str) -> Any:
    status, body = http_get(agent.url + path)
    assert status == 200, body
    return json.loads(body)


@pytest.mark.parametrize("framework", ["ddp", "deepspeed"])
def test_a_job_is_traced_automatically_and_on_demand(tmp_path: Path, framework: str) -> None:
    trace_dir = tmp_path / "traces"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPUMON_TRACE_DIR": str(trace_dir),
           "GPUMON_TRACE_AUTO": "true", "GPUMON_TRACE_AUTO_WINDOWS": "2"}
    agent = start_agent(tmp_path, "--interval", "0.5", "--record", str(tmp_path / RECORDING), env=env)
    stop = tmp_path / "stop"
    job_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for name in ("GPUMON_RUN", "GPUMON_SOCKET", "GPUMON_PURE_PYTHON", "GPUMON_RUN_DISABLE"):
        job_env.pop(name, None)
    if framework == "ddp":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", str(free_port())]
    else:
        launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2",
                    "--master_port", str(free_port())]
    command = [sys.executable, "-m", "gpumon.cli", "run", "--run", "traced", "--socket",
               str(agent.socket_path), "--", *launcher, str(JOBS / "trace_job.py"), framework,
               "--out", str(tmp_path / "out"), "--stop", str(stop), "--slow-rank-ms", "6"]
    job = subprocess.Popen(command, env=job_env, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        # The rule: rank 0 waits for rank 1 in the all-reduce (communication) window after
        # window; one trace is asked of it without anyone asking.
        auto = wait_for(lambda: [r for r in _api(agent, "/api/v1/traces")["requests"]
                                 if r["trigger"] != "request" and r["state"] == "done"],
                        timeout=90, what="an automatic trace")
        asked = subprocess.run([sys.executable, "-m", "gpumon.cli", "trace", "--url", agent.url,
                                "--run", "traced", "--all-ranks", "--steps", "3", "--wait"],
                               capture_output=True, text=True, env=job_env, cwd=ROOT, timeout=120)
        assert asked.returncode == 0, asked.stderr
        paths = [Path(line) for line in asked.stdout.split()]
        listed = subprocess.run([sys.executable, "-m", "gpumon.cli", "trace", "--url", agent.url,
                                 "--list"], capture_output=True, text=True, env=job_env, cwd=ROOT)
        metrics = agent.metrics()
    finally:
        stop.touch()
        out, _ = job.communicate(timeout=120)
        agent.stop()
    assert job.returncode == 0, out[-4000:]

    assert sorted(p.name.split(".step")[0] for p in paths) == ["traced.rank0", "traced.rank1"]
    for path in paths:
        assert path.parent == trace_dir and (path.stat().st_mode & 0o777) == 0o600
        assert str(path) in listed.stdout
    # A request that meets an automatic trace under way gets that one (two requests, one trace).
    asked_by_hand = [v for labels, v in series(metrics, "gpumon_traces_total", run="traced")
                     if labels["trigger"] == "request"]
    assert asked_by_hand and sum(asked_by_hand) <= 2
    first = auto[0]
    assert value(metrics, "gpumon_traces_total", run="traced", rank=str(first["rank"]),
                 trigger=first["trigger"]) == 1
    # The latest trace of each rank, for the alerts' annotations (an automatic one may have
    # come after the ones asked for).
    info = series(metrics, "gpumon_trace_info", run="traced")
    assert sorted(labels["rank"] for labels, _ in info) == ["0", "1"]
    for labels, _ in info:
        path = Path(labels["path"])
        assert path.parent == trace_dir and f".rank{labels['rank']}." in path.name and path.exists()

    # Every rank's trace loads in Holistic Trace Analysis.
    from hta.trace_analysis import TraceAnalysis

    requested = tmp_path / "requested"
    requested.mkdir()
    for path in paths:
        (requested / path.name).symlink_to(path)
    analysis = TraceAnalysis(trace_dir=str(requested))
    assert sorted(analysis.t.get_ranks()) == [0, 1]
    for rank in (0, 1):
        names = set(analysis.t.get_trace(rank)["name"].map(analysis.t.symbol_table.sym_table.__getitem__))
        wanted = {"gpumon.forward", "gpumon.backward", "gpumon.optimizer"}
        assert wanted | ({"gpumon.data"} if framework == "ddp" else set()) <= names

    # Each traced step's phase ranges sum to what the agent recorded for that step.
    recorded = {(s["rank"], s["step"]): s for s in Job(tmp_path, tmp_path / RECORDING, "traced").steps()}
    for path in paths:
        rank = int(path.name.split(".rank")[1].split(".")[0])
        sums = phase_sums(_trace_events(path))
        assert len(sums) == 3
        for step, phases in sums.items():
            wanted = recorded[(rank, step)]["phases"]
            assert set(phases) == set(wanted), (phases, wanted)
            for name, seconds in phases.items():
                assert abs(seconds - wanted[name]) <= PHASE_BOUND_S, (rank, step, name, seconds, wanted)


def test_a_trace_of_a_rank_that_is_gone_or_unknown_is_answered_at_once(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    agent = start_agent(tmp_path, env={**env, "GPUMON_TRACE_DIR": str(tmp_path / "traces")})
    gone = ("from gpumon.client import StepMonitor\n"
            f"mon = StepMonitor('gone', socket_path={str(agent.socket_path)!r}, rank=0, world=1)\n"
            "for _ in range(3):\n    with mon.step(): pass\nmon.close()\n")

    def trace(run: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpumon.cli", "trace", "--url", agent.url,
                               "--run", run, "--rank", "0", "--wait"],
                              capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)

    try:
        subprocess.run([sys.executable, "-c", gone], check=True, env=env, cwd=ROOT, timeout=60)
        wait_for(lambda: any(r["run"] == "gone" for r in _api(agent, "/api/v1/snapshot")["ranks"]),
                 what="the rank's steps")
        unknown, exited = trace("nobody"), trace("gone")
        metrics = agent.metrics()
    finally:
        agent.stop()
    assert unknown.returncode == 1, unknown
    assert "rank 0 of run 'nobody' does not report to this agent" in unknown.stderr
    assert exited.returncode == 1, exited
    assert "no process of rank 0 of run 'gone' listens for trace requests" in exited.stderr
    assert value(metrics, "gpumon_trace_errors_total", reason="no_channel") == 1
