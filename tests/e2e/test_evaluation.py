"""An evaluation pass is told from a hang as it runs: a real loop (torch on CPU, the device's
time as sleeps) trains, evaluates with cheap forwards each followed by a wait on the host
outside any module call (the shape of a GPU evaluation), trains again, then hangs in a forward
that never returns. A real agent's ``gpumon_rank_state``, scraped every 0.25 s, against the
job's own notes of what it was doing and when.

The hook's stall floor is 2 s (``GPUMON_STALL_AFTER_S``), so that the evaluation lasts three
thresholds in seconds; the rule is the same at its default 20 s floor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumon.testing import AgentProcess
from gpumon.testing.metrics import series
from gpumon.testing.processes import kill_tree
from tests.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.agent("--interval", "0.5")]

JOB = Path(__file__).resolve().parent / "jobs" / "eval_job.py"
STALL_FLOOR_S = 2.0
EVAL_BATCHES = 120  # 6 s of evaluation: three thresholds
RUN = "eval-job"


def state(agent: AgentProcess) -> str | None:
    for labels, v in series(agent.metrics(), "gpumon_rank_state", run=RUN):
        if v == 1.0:
            return labels["state"]
    return None


def notes(path: Path) -> dict[str, float]:
    if not path.exists():
        return {}
    return {(n := json.loads(line))["what"]: n["t"] for line in path.read_text().splitlines()}


@pytest.mark.parametrize("how", ["gpumon run", "hooked"])
def test_cheap_forwards_with_host_waits_read_evaluating_and_a_forward_that_never_returns_stalled(
        agent: AgentProcess, tmp_path: Path, how: str) -> None:
    written = tmp_path / "notes.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMON_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GPUMON_STALL_AFTER_S=str(STALL_FLOOR_S),
               GPUMON_SOCKET=str(agent.socket_path), GPUMON_RUN=RUN)
    job_args = [sys.executable, str(JOB), str(written), "30", str(EVAL_BATCHES)]
    if how == "hooked":
        command = [*job_args, "--hooked"]
    else:
        command = [sys.executable, "-m", "gpumon.cli", "run", "--", *job_args]
    log = (tmp_path / "job.log").open("wb")
    job = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    seen: list[tuple[float, str | None]] = []
    try:
        deadline = time.monotonic() + 120
        while "hung" not in notes(written) or not seen or seen[-1][1] != "stalled":
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (seen[-20:], notes(written))
            seen.append((time.time(), state(agent)))
            time.sleep(0.25)
    finally:
        kill_tree(job.pid)
        job.wait(timeout=30)
        log.close()
    when = notes(written)
    evaluation = [s for t, s in seen if when["evaluating"] <= t < when["training"]]
    assert "stalled" not in evaluation, evaluation
    # the evaluation lasts three thresholds: from the first threshold on, it reads evaluating
    assert evaluation.count("evaluating") >= 8, evaluation
    assert "stalled" not in [s for t, s in seen if t < when["hung"]]
    stalled_at = next(t for t, s in seen if s == "stalled")
    # stalled one threshold after the forward began, within the sender's and the scrape's ticks
    assert STALL_FLOOR_S <= stalled_at - when["hung"] <= STALL_FLOOR_S + 3.0
