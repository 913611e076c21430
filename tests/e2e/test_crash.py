"""A rank that dies loses at most one step's record: real two-rank DDP jobs (gloo) whose rank 1
dies by ``os._exit``, by SIGKILL and by a segfault, hooked and under ``gpumon run``, against a
real agent; the ground truth is the steps the job itself wrote down, each before the next began.

The agent counts what its step ring gave back (``gpumon_ingest_ring_records_total``): without
those records it would miss more than one step (as ``GPUMON_RING=0``, the hook without a ring,
does), so each test fails on a hook without the ring."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumon.testing import AgentProcess, free_port
from gpumon.testing.metrics import first
from tests.e2e.distributed import AGENT, JOBS, ROOT, Job
from tests.helpers import RECORDING

pytestmark = [pytest.mark.slow, AGENT]

AT = 50
"""Rank 1 dies after this many steps."""
SETTLE_S = 30.0
"""The agent sees a process's end within 5 s (its liveness cycle); then it reads the ring."""


def _crash(agent: AgentProcess, tmp_path: Path, run: str, death: str, watched: bool,
           ring: bool = True) -> tuple[int, float, float, Job]:
    """Run the job until rank 1 dies and the agent has seen it: (rank 1's true step count,
    the agent's gpumon_steps_total for it, what the rings gave back, the job)."""
    out = tmp_path / run
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("GPUMON_RUN", "GPUMON_SOCKET", "GPUMON_PURE_PYTHON", "GPUMON_RING"):
        env.pop(name, None)
    if not ring:
        env["GPUMON_RING"] = "0"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port()), str(JOBS / "crash_job.py"), "--out", str(out),
                "--die", death, "--at", str(AT)]
    if watched:
        command = [sys.executable, "-m", "gpumon.cli", "run", "--run", run, "--socket",
                   str(agent.socket_path), "--", *torchrun]
    else:
        env.update(GPUMON_SOCKET=str(agent.socket_path), GPUMON_RUN=run)
        command = [*torchrun, "--hooked"]
    job = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if death == "kill":
            dying = out / "rank1.dying"
            deadline = time.monotonic() + 180
            while not dying.exists() or not dying.read_text().strip():
                assert time.monotonic() < deadline and job.poll() is None, "rank 1 never got there"
                time.sleep(0.05)
            os.kill(int(dying.read_text()), signal.SIGKILL)
        output, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode != 0, output.decode(errors="replace")[-3000:]
    truth = len((out / "rank1.steps").read_text().split())
    assert truth == AT, output.decode(errors="replace")[-3000:]
    deadline = time.monotonic() + SETTLE_S
    steps = recovered = 0.0
    while time.monotonic() < deadline:
        metrics = agent.metrics()
        exited = first(metrics, "gpumon_rank_state", run=run, rank="1", state="exited")
        steps = first(metrics, "gpumon_steps_total", run=run, rank="1") or 0.0
        recovered = first(metrics, "gpumon_ingest_ring_records_total") or 0.0
        if exited == 1.0:
            break
        time.sleep(0.5)
    time.sleep(1.5)  # the recording is written every second
    return truth, steps, recovered, Job(out, tmp_path / RECORDING, run)


@pytest.mark.parametrize("death", ["exit", "kill", "segv"])
@pytest.mark.parametrize("watched", [False, True], ids=["hooked", "gpumon-run"])
def test_a_rank_that_dies_loses_at_most_one_step(agent: AgentProcess, tmp_path: Path, death: str,
                                                 watched: bool) -> None:
    truth, steps, recovered, job = _crash(agent, tmp_path, f"crash-{death}", death, watched)
    assert truth - 1 <= steps <= truth, (truth, steps, recovered, agent.log()[-3000:])
    recorded = job.steps(rank=1)
    assert truth - 1 <= len(recorded) <= truth
    assert len({s["step"] for s in recorded}) == len(recorded)  # nothing counted twice
    # The ring gave back what the sender had not sent: without it, more than one step is lost.
    assert steps - recovered < truth - 1, (truth, steps, recovered)


def test_without_the_ring_a_dying_rank_loses_its_last_steps(agent: AgentProcess,
                                                            tmp_path: Path) -> None:
    truth, steps, recovered, _ = _crash(agent, tmp_path, "crash-noring", "exit", False, ring=False)
    assert recovered == 0
    assert steps < truth - 1, (truth, steps)
