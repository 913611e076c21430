"""Two jobs of the same script on one agent, each started on its own under ``gpumon run``, so
both report under the script's name: the rank's series stay the first job's, the second is
watched as a run of its own and the conflict is counted. And a rank whose process exits
continues under the next process, without a conflict (a restart).

Real processes (torch on CPU, the device's time as sleeps), a real agent, its /metrics; the
step counts are the jobs' own (each prints one line per step)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumon.agent.collectors.owners import OWNERS_INTERVAL_S
from gpumon.collectors.process_owner import user_name
from gpumon.testing import AgentProcess, values, wait_for
from tests.helpers import ROOT

JOB = Path(__file__).resolve().parent / "jobs" / "paced_train.py"
RUN = "paced_train"  # the script's name: nothing else names these jobs
TIMEOUT_S = 120

pytestmark = [pytest.mark.slow, pytest.mark.agent("--interval", "0.5")]


def watched(agent: AgentProcess, steps: int, period_s: float,
            gate: Path | None = None) -> subprocess.Popen[str]:
    """``gpumon run -- python paced_train.py STEPS PERIOD_S [GATE]``, with no job name in its
    environment (no Slurm, Kubernetes or torchrun variables), started now."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "GPUMON_", "TORCHELASTIC_", "PET_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "gpumon.cli", "run", "--socket", str(agent.socket_path), "--",
               sys.executable, str(JOB), str(steps), str(period_s), *([str(gate)] if gate else [])]
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def ready(job: subprocess.Popen[str]) -> None:
    """Wait until the job is set up and waits at its gate."""
    assert job.stdout is not None
    line = job.stdout.readline()
    assert line == "ready\n", (line, job.stderr.read() if job.poll() is not None and job.stderr else "")


def finished(job: subprocess.Popen[str]) -> int:
    """The steps the job counted itself; it must have exited 0."""
    out, err = job.communicate(timeout=TIMEOUT_S)
    assert job.returncode == 0, err[-3000:]
    assert f"watching run '{RUN}'" in err
    return sum(line.startswith("step ") for line in out.splitlines())


def steps_by_run(agent: AgentProcess) -> dict[str, float]:
    return {labels["run"]: v for (name, labels_t), v in agent.metrics().items()
            if name == "gpumon_steps_total" and (labels := dict(labels_t))["run"].startswith(RUN)}


def test_two_jobs_of_one_script_are_counted_apart(agent: AgentProcess, tmp_path: Path) -> None:
    """Both step at once (60 x 50 ms, 15 x 200 ms); whichever reports first keeps the rank."""
    gate = tmp_path / "go"
    fast, slow = watched(agent, 60, 0.05, gate), watched(agent, 15, 0.2, gate)
    ready(fast)
    ready(slow)
    gate.touch()
    assert (finished(fast), finished(slow)) == (60, 15)
    wait_for(lambda: len(steps_by_run(agent)) == 2 and sum(steps_by_run(agent).values()) == 75,
             timeout=15, what=f"two runs, got {steps_by_run(agent)}")
    metrics = agent.metrics()
    # gpumon run becomes the job (exec): the job's pid is the one Popen gave
    pids = {dict(labels)["run"]: int(dict(labels)["pid"]) for (name, labels) in metrics
            if name == "gpumon_rank_info" and dict(labels)["run"].startswith(RUN)}
    owner, clashed = (fast, slow) if pids[RUN] == fast.pid else (slow, fast)
    clash = f"{RUN}:clash-{clashed.pid}"
    assert pids == {RUN: owner.pid, clash: clashed.pid}
    assert steps_by_run(agent) == {RUN: 60.0 if owner is fast else 15.0,
                                   clash: 15.0 if owner is fast else 60.0}
    assert values(metrics, "gpumon_rank_conflicts_total", run=RUN, rank="0") == [1.0]
    log = agent.log()
    assert log.count("claims the rank while process") == 1, log[-3000:]


def test_a_process_after_the_last_one_exited_continues_the_rank(agent: AgentProcess) -> None:
    first = watched(agent, 10, 0.05)
    assert finished(first) == 10
    wait_for(lambda: steps_by_run(agent) == {RUN: 10.0}, timeout=15, what="the first steps")
    second = watched(agent, 10, 0.05)  # a restart: the same run and rank, a new process
    assert finished(second) == 10
    wait_for(lambda: steps_by_run(agent) == {RUN: 20.0}, timeout=15,
             what=f"one rank of 20 steps, got {steps_by_run(agent)}")
    metrics = agent.metrics()
    assert values(metrics, "gpumon_rank_conflicts_total") == []
    assert values(metrics, "gpumon_rank_info", run=RUN, pid=str(second.pid))


def owner_of_rank(agent: AgentProcess) -> str | None:
    """The ``user`` label of the job's rank (None before the rank is shown)."""
    for (name, labels_t), _ in agent.metrics().items():
        labels = dict(labels_t)
        if name == "gpumon_rank_info" and labels["run"] == RUN:
            return labels["user"]
    return None


@pytest.mark.agent()
def test_a_short_job_is_attributed_from_its_first_scrape_to_after_it_ended(
        agent: AgentProcess) -> None:
    """An agent as it runs, its owners cycle at its 5 s default; the job (60 x 50 ms) starts
    3 s after it. Every scrape that shows the rank names its user, and so do scrapes after the
    process exited and later owners cycles ran."""
    me = user_name(os.getuid())
    time.sleep(3.0)
    job = watched(agent, 60, 0.05)
    seen: list[str | None] = []
    while job.poll() is None:
        seen.append(owner_of_rank(agent))
        time.sleep(0.1)
    assert finished(job) == 60
    shown = [u for u in seen if u is not None]
    assert shown and set(shown) == {me}, seen
    ended = time.monotonic()
    while time.monotonic() - ended < 2 * OWNERS_INTERVAL_S + 1:  # two cycles after the exit
        assert owner_of_rank(agent) == me
        time.sleep(0.5)
