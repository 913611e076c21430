"""Where real runs' time went, against each job's own timeline: a torchrun job restarted after a
crash, resuming from its last checkpoint (no gpumon code in it, under ``gpumon run``).

The truth is what the processes wrote themselves (``jobs/restart_job.py``): their kernel start
times, each step, save and restore, and their exits. For each rank, goodput plus badput is its
wall time within 10 %, and each cause is within 30 % of the truth.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpumon.analysis.goodput import CAUSES
from gpumon.testing import AgentProcess
from gpumon.testing.metrics import value
from tests.e2e.distributed import AGENT, JOBS, watched

pytestmark = [pytest.mark.slow, AGENT]

RUN = "restart-job"
STEPS, EVERY, CRASH_AFTER = 100, 20, 50


def timeline(out: Path, rank: int, attempt: int) -> list[dict[str, Any]]:
    path = out / f"rank{rank}.attempt{attempt}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def truth(out: Path, rank: int) -> dict[str, float]:
    """Where the rank's time went, by its own notes."""
    attempts = [timeline(out, rank, a) for a in (0, 1)]
    saved = max(e["step"] for a in (0,) for e in timeline(out, 0, a) if e["what"] == "save_end")
    got: dict[str, float] = dict.fromkeys(CAUSES, 0.0)
    got["goodput"] = 0.0
    for n, events in enumerate(attempts):
        start = next(e["at"] for e in events if e["what"] == "start")
        first = next(e["t"] for e in events if e["what"] == "step_start")
        got["startup"] += first - start
        begun: dict[int, float] = {}
        for e in events:
            if e["what"] == "step_start":
                begun[e["step"]] = e["t"]
            elif e["what"] == "step_end":
                seconds = e["t"] - begun[e["step"]]
                got["lost" if n == 0 and e["step"] > saved else "goodput"] += seconds
            elif e["what"] == "save_end":
                got["checkpoint"] += e["t"] - next(
                    s["t"] for s in events if s["what"] == "save_start" and s["step"] == e["step"])
    exit0 = next(e["t"] for e in attempts[0] if e["what"] == "exit")
    got["restart"] = next(e["at"] for e in attempts[1] if e["what"] == "start") - exit0
    got["wall"] = (next(e["t"] for e in attempts[1] if e["what"] == "exit")
                   - next(e["at"] for e in attempts[0] if e["what"] == "start"))
    return got


def measured(agent: AgentProcess, rank: int) -> dict[str, float]:
    metrics = agent.metrics()
    labels = {"run": RUN, "rank": str(rank)}
    got = {cause: value(metrics, "gpumon_badput_seconds_total", cause=cause, **labels)
           for cause in CAUSES}
    got["goodput"] = value(metrics, "gpumon_goodput_seconds_total", **labels)
    got["unsaved"] = value(metrics, "gpumon_unsaved_seconds", **labels)
    got["restarts"] = value(metrics, "gpumon_rank_restarts_total", **labels)
    got["saves"] = value(metrics, "gpumon_checkpoints_total", kind="save", result="ok", **labels)
    got["loads"] = value(metrics, "gpumon_checkpoints_total", kind="load", result="ok", **labels)
    return got


def test_a_restarted_run_accounts_every_second_of_each_rank(agent: AgentProcess,
                                                            tmp_path: Path) -> None:
    out = tmp_path / RUN
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1"]
    watched(agent, tmp_path, RUN, [str(JOBS / "restart_job.py"), "--out", str(out),
                                   "--steps", str(STEPS), "--every", str(EVERY),
                                   "--crash-after", str(CRASH_AFTER)],
            # each rank: every step up to the crash, then from the checkpoint before it on
            expect_steps=2 * CRASH_AFTER + 2 * (STEPS - 2 * EVERY), launcher=launcher,
            crashes=2)  # the crashing rank, and its peer torchrun stops
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and measured(agent, 1)["unsaved"] > 0:
        time.sleep(0.25)  # the last records (the clean finish) arrive
    for rank in (0, 1):
        want, got = truth(out, rank), measured(agent, rank)
        report = f"rank {rank}: truth {want}, gpumon {got}"
        total = got["goodput"] + sum(got[c] for c in CAUSES)
        assert total == pytest.approx(want["wall"], rel=0.10), report
        assert got["unsaved"] == 0.0, report  # the run finished cleanly: everything kept
        assert got["restarts"] == 1, report
        assert got["loads"] == 1, report
        for part in ("goodput", "startup", "lost", "restart"):
            assert got[part] == pytest.approx(want[part], rel=0.30), (part, report)
        if rank == 0:
            assert got["checkpoint"] == pytest.approx(want["checkpoint"], rel=0.30), report
            assert got["saves"] == STEPS // EVERY, report
