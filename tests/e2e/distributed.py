"""Running small multi-process training jobs under ``torch.distributed.run`` against a real
agent, and reading back what the agent recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpumon.analysis.bottleneck import Verdict
from gpumon.commands.classify import classify_file
from gpumon.testing import AgentProcess, free_port
from tests.helpers import RECORDING

ROOT = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent / "jobs"
JOB_TIMEOUT_S = 240
WATCHED_TIMEOUT_S = 300


@dataclass
class Job:
    """What a finished job left: each rank's own summary, and the agent's recording."""

    out: Path
    recording: Path
    run: str

    def summary(self, rank: int) -> dict[str, Any]:
        summary: dict[str, Any] = json.loads((self.out / f"rank{rank}.json").read_text())
        return summary

    def verdicts(self, rank: int) -> list[Verdict]:
        """One verdict per step of ``rank``, from the agent's recording replayed through the
        same verdict engine (``gpumon classify``)."""
        _, verdicts = classify_file(self.recording)
        return [v.verdict for v in verdicts if v.run == self.run and v.rank == rank for _ in v.steps]

    def first_window(self, rank: int) -> tuple[int, ...]:
        """The steps of ``rank``'s first verdict window."""
        _, verdicts = classify_file(self.recording)
        return next(v.steps for v in verdicts if v.run == self.run and v.rank == rank)

    def steps(self, rank: int | None = None) -> list[dict[str, Any]]:
        """The recorded step lines of this job (of one rank), in step order."""
        lines = [json.loads(line) for line in self.recording.read_text().splitlines() if line.strip()]
        steps = [s for s in lines if s.get("kind") == "step" and s.get("run") == self.run
                 and (rank is None or s.get("rank") == rank)]
        return sorted(steps, key=lambda s: (s["rank"], s["step"]))


AGENT = pytest.mark.agent("--interval", "0.5", record=True)
"""How the distributed tests' agent runs: recording every step to the test's recording file."""


def run_job(agent: AgentProcess, tmp_path: Path, script: str, nproc: int,
            args: Sequence[str], run: str, expect_steps: int) -> Job:
    """Launch ``jobs/<script>`` on ``nproc`` ranks reporting to ``agent`` (``AGENT``) as run
    ``run``; return once it exited 0 and the agent recorded ``expect_steps`` steps of it."""
    recording = tmp_path / RECORDING
    out = tmp_path / run
    env = {**os.environ, "GPUMON_SOCKET": str(agent.socket_path), "GPUMON_RUN": run,
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("GPUMON_PURE_PYTHON", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), str(JOBS / script), "--out", str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, f"job failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    job = Job(out, recording, run)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the agent writes its recording every second
        if recording.exists() and len(job.steps()) >= expect_steps:
            break
        time.sleep(0.2)
    assert len(job.steps()) == expect_steps, (len(job.steps()), agent.log()[-3000:])
    return job


def watched(agent: AgentProcess, tmp_path: Path, run: str, command: list[str], expect_steps: int,
            torchrun: int = 0, launcher: list[str] | None = None, crashes: int = 0) -> Job:
    """Run ``command`` under ``gpumon run --run RUN`` (under torchrun on ``torchrun`` ranks, or
    under ``launcher``); return once it exited 0 and the agent recorded ``expect_steps`` steps
    of it (less at most one for each of its processes that ``crashes``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for name in ("GPUMON_RUN", "GPUMON_SOCKET", "GPUMON_PURE_PYTHON", "GPUMON_RUN_DISABLE"):
        env.pop(name, None)
    if launcher:
        command = [*launcher, *command]
    elif torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun),
                   "--master-port", str(free_port()), *command]
    else:
        command = [sys.executable, *command]
    gpumon = [sys.executable, "-m", "gpumon.cli", "run", "--run", run, "--socket", str(agent.socket_path),
              "--"]
    done = subprocess.run(gpumon + command, capture_output=True, text=True,
                          timeout=WATCHED_TIMEOUT_S, env=env, cwd=ROOT)
    assert done.returncode == 0, f"job failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    job = Job(tmp_path / run, tmp_path / RECORDING, run)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (job.recording.exists() and len(job.steps()) >= expect_steps):
        time.sleep(0.2)
    assert expect_steps - crashes <= len(job.steps()) <= expect_steps, (
        len(job.steps()), agent.log()[-3000:])
    return job


def share_of(verdicts: list[Verdict], primary: str) -> float:
    """The fraction of ``verdicts`` whose primary bottleneck is ``primary``."""
    return sum(v.primary.value == primary for v in verdicts) / len(verdicts)


def flagged_share(verdicts: list[Verdict]) -> float:
    """The fraction of ``verdicts`` flagging their rank as the run's straggler."""
    return sum(any(f.value == "straggler" for f in v.flags) for v in verdicts) / len(verdicts)


def exposed_share(steps: list[dict[str, Any]]) -> float:
    """Exposed communication seconds over step seconds."""
    return float(sum(s["comm"]["exposed"] for s in steps)) / float(sum(s["duration"] for s in steps))



RESTART_STEPS, RESTART_EVERY, RESTART_CRASH_AFTER = 100, 20, 50
"""``jobs/restart_job.py``'s run: its steps, its checkpoint interval, the step its rank 1 dies in
on the first attempt."""


def restarted_job(agent: AgentProcess, tmp_path: Path, run: str) -> Job:
    """``jobs/restart_job.py`` on 2 ranks under ``gpumon run`` and ``torchrun --max-restarts 1``:
    rank 1 dies mid-step after ``RESTART_CRASH_AFTER`` steps, torchrun restarts both ranks, which
    restore the last checkpoint and finish; each process writes its own timeline under
    ``tmp_path / run``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1"]
    redone = RESTART_STEPS - 2 * RESTART_EVERY  # from the checkpoint before the crash on
    return watched(agent, tmp_path, run, [str(JOBS / "restart_job.py"), "--out", str(tmp_path / run),
                                          "--steps", str(RESTART_STEPS), "--every", str(RESTART_EVERY),
                                          "--crash-after", str(RESTART_CRASH_AFTER)],
                   expect_steps=2 * RESTART_CRASH_AFTER + 2 * redone, launcher=launcher,
                   crashes=2)  # the crashing rank, and its peer torchrun stops
