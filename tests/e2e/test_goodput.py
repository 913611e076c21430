"""Where real runs' time went, against each job's own timeline (``timelines.py``), under
``gpumon run`` with no gpumon code in the jobs: a Hugging Face ``Trainer`` with ``save_steps``
that crashes and is run again with ``resume_from_checkpoint``; a job saving with
``torch.distributed.checkpoint``'s ``async_save`` that crashes while its last save is still
writing. (A torchrun job restarted after a crash is checked the same way, and then through its
report, in ``tests/report/test_report_goodput.py``: one run for both.)

The truth is what the processes wrote themselves: their kernel start times, each step, save
and restore, and their exits. For each rank, goodput plus badput is its wall time within 10 %,
and each cause is within 30 % of the truth.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumon.analysis.goodput import CAUSES
from gpumon.testing import AgentProcess
from tests.e2e.distributed import AGENT, JOBS
from tests.e2e.timelines import check, measured, notes, truth
from tests.helpers import ROOT

pytestmark = [pytest.mark.slow, AGENT]



def gpumon_run(agent: AgentProcess, run: str, args: list[str]) -> int:
    """Run a job under ``gpumon run``; its exit status (a crash is expected of some)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("GPUMON_RUN", "GPUMON_SOCKET", "GPUMON_PURE_PYTHON", "GPUMON_RUN_DISABLE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "gpumon.cli", "run", "--run", run, "--socket",
                           str(agent.socket_path), "--", sys.executable, *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    return done.returncode


def settled(agent: AgentProcess, run: str, want: float) -> dict[str, float]:
    """The rank's figures once their goodput and badput account for ``want`` seconds (the
    last records arrive after the process ends), or as they are after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        got = measured(agent, run, 0)
        if got["goodput"] + sum(got[c] for c in CAUSES) >= 0.95 * want \
                or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


def test_a_hugging_face_run_resumed_from_its_checkpoint(agent: AgentProcess,
                                                        tmp_path: Path) -> None:
    run, out = "hf-resume", tmp_path / "hf-resume"
    job = [str(JOBS / "hf_resume_job.py"), "--out", str(out), "--steps", "40", "--every", "10"]
    assert gpumon_run(agent, run, [*job, "--crash-at", "25"]) == 1
    time.sleep(2.0)  # the scheduler takes its time to run it again
    assert gpumon_run(agent, run, [*job, "--attempt", "1", "--resume"]) == 0
    want = truth([notes(out / "attempt0.jsonl"), notes(out / "attempt1.jsonl")])
    got = settled(agent, run, want["wall"])
    check(want, got, "hf")
    assert got["unsaved"] == 0.0 and got["restarts"] == 1, got
    assert got["saves"] == 4 and got["loads"] == 1, got  # 10, 20; 30, 40; the resume


def test_an_async_save_counts_what_it_blocked_and_keeps_only_once_written(
        agent: AgentProcess, tmp_path: Path) -> None:
    run, out = "dcp-async", tmp_path / "dcp-async"
    job = [str(JOBS / "dcp_async_job.py"), "--out", str(out), "--steps", "60", "--every", "20",
           "--crash-at", "45"]
    assert gpumon_run(agent, run, job) == 1
    want = truth([notes(out / "attempt0.jsonl")])
    done = [e["step"] for e in notes(out / "attempt0.jsonl") if e["what"] == "save_done"]
    assert done == [20]  # the save of step 40 was still writing when the job died
    got = settled(agent, run, want["wall"])
    check(want, got, "dcp")
    assert got["saves"] == 1, got  # the save of step 20; step 40's never completed
    assert got["unsaved"] == 0.0, got  # lost at the crash
