"""Unmodified training jobs through ``gpumon run`` against a real agent, beside what the jobs
count themselves and what the same jobs hooked by hand report: the CPU example (input-bound
and not: the same verdicts as ``examples/train_cpu.py`` hooked), a communication-heavy 2-rank
DDP job under torchrun (its exposed time within its own clocks over backward), Lightning's
``ddp`` strategy on 2 devices and a Hugging Face ``Trainer`` under torchrun, both with four
micro-batches per optimizer step, and a DeepSpeed ZeRO-1 engine under the ``deepspeed``
launcher, four micro-batches per optimizer step: one step per optimizer step on every rank.
(A job with a monitor of its own is not counted twice: tests/client/test_autowatch_hooks.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from gpumon.testing import AgentProcess, free_port
from tests.e2e.accuracy import Bound, judged, rows_of, within_clocks
from tests.e2e.distributed import AGENT, Job, share_of, watched
from tests.helpers import RECORDING, ROOT

JOBS = Path(__file__).resolve().parent / "jobs"
TIMEOUT_S = 300
STEPS = 8

pytestmark = [pytest.mark.slow, AGENT]


def hooked(agent: AgentProcess, run: str, args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "examples/train_cpu.py", "--run", run, "--socket", str(agent.socket_path),
               *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def primary(job: Job) -> str:
    """The verdict most of the run's steps got."""
    return Counter(v.primary.value for v in job.verdicts(0)).most_common(1)[0][0]


@pytest.mark.parametrize("input_bound", [True, False], ids=["input-bound", "not-input-bound"])
def test_the_cpu_example_unmodified_gets_the_verdicts_it_gets_hooked(
    agent: AgentProcess, tmp_path: Path, input_bound: bool
) -> None:
    args = ["--steps", "60", "--warmup", "1", "--threads", "1"] + (["--input-bound"] if input_bound else [])
    hooked(agent, "hooked", args)
    plain = watched(agent, tmp_path, "plain", ["examples/train_plain.py", *args], expect_steps=60)
    by_hand = Job(tmp_path / "hooked", tmp_path / RECORDING, "hooked")
    assert len(by_hand.steps()) == 60
    assert primary(plain) == primary(by_hand)
    if input_bound:
        assert primary(plain) == "input" and share_of(plain.verdicts(0), "input") >= 0.8
    else:
        assert primary(plain) != "input" and share_of(plain.verdicts(0), "input") <= 0.2
    for step in plain.steps():
        assert {"data", "forward", "backward", "optimizer"} <= set(step["phases"])
        assert step["samples"] == 64


def test_comm_heavy_ddp_unmodified_is_exposed_as_long_as_its_ranks_waited(
    agent: AgentProcess, tmp_path: Path
) -> None:
    warmup = 3
    job = watched(agent, tmp_path, "ddp-plain",
                  [str(JOBS / "plain_job.py"), "ddp", "--out", str(tmp_path / "ddp-plain"),
                   "--steps", "14", "--warmup", str(warmup)],
                  expect_steps=2 * (14 + warmup), torchrun=2)
    for rank in (0, 1):
        summary = job.summary(rank)
        steps = job.steps(rank)
        assert len(steps) == summary["optimizer_steps"]  # the twins on the helper thread: not steps
        synced = [s for s in steps if s["step"] >= warmup]
        for step in synced:
            count, size, _ = step["comm"]["ops"]["all_reduce"]
            assert size == summary["grad_bytes"] and count == 3
            assert {"forward", "backward", "optimizer"} <= set(step["phases"])
        assert share_of(job.verdicts(rank), "communication") >= 0.8
    # Each step waits for its 64 MiB all-reduce as long as the training thread's clocks over
    # backward show it off a CPU (N: 0), not through its work there (A: the whole step);
    # between the bounds lies its run delay, where B (little overlaps) and U may fall.
    rows = [row for rank in (0, 1) for row in rows_of(job, rank) if row["line"]["step"] >= warmup]
    judged([Bound("within the job's clocks", within_clocks(cpu_in_comm=True), fails="NA", either="BU")], rows)


def test_lightning_ddp_unmodified_counts_one_step_per_optimizer_step(
    agent: AgentProcess, tmp_path: Path
) -> None:
    job = watched(agent, tmp_path, "lightning-plain",
                  [str(JOBS / "plain_job.py"), "lightning", "--out", str(tmp_path / "lightning-plain"),
                   "--steps", str(STEPS)], expect_steps=2 * STEPS)
    for rank in (0, 1):
        summary, steps = job.summary(rank), job.steps(rank)
        assert summary["strategy"] == "DDPStrategy"
        assert len(steps) == summary["optimizer_steps"] == STEPS
        assert summary["micro_batches"] == 4 * STEPS
        for step in steps:
            assert step["world"] == 2 and step["samples"] >= 4 * 2
            count, _, _ = step["comm"]["ops"]["all_reduce"]
            assert count >= 1  # the fourth micro-batch's; the first three run under no_sync
            assert {"data", "forward", "backward", "optimizer"} <= set(step["phases"])


def test_hf_trainer_unmodified_under_torchrun_counts_one_step_per_optimizer_step(
    agent: AgentProcess, tmp_path: Path
) -> None:
    job = watched(agent, tmp_path, "hf-plain",
                  [str(JOBS / "plain_job.py"), "hf", "--out", str(tmp_path / "hf-plain"),
                   "--steps", str(STEPS)], expect_steps=2 * STEPS, torchrun=2)
    for rank in (0, 1):
        summary, steps = job.summary(rank), job.steps(rank)
        assert summary["wrapped"] == "DistributedDataParallel"
        assert len(steps) == summary["optimizer_steps"] == STEPS
        assert summary["micro_batches"] == 4 * STEPS
        for step in steps:
            count, _, _ = step["comm"]["ops"]["all_reduce"]
            assert count >= 1
            assert 0 < step["comm"]["exposed"] <= step["comm"]["busy"] <= step["duration"]


def test_deepspeed_unmodified_under_its_launcher_counts_one_step_per_optimizer_step(
    agent: AgentProcess, tmp_path: Path
) -> None:
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2",
                "--master_port", str(free_port())]
    job = watched(agent, tmp_path, "deepspeed-plain",
                  [str(JOBS / "plain_job.py"), "deepspeed", "--out", str(tmp_path / "deepspeed-plain"),
                   "--steps", str(STEPS)], expect_steps=2 * STEPS, launcher=launcher)
    for rank in (0, 1):
        summary, steps = job.summary(rank), job.steps(rank)
        assert len(steps) == summary["optimizer_steps"] == summary["inner_steps"] == STEPS
        assert summary["micro_batches"] == 4 * STEPS
        for step in steps:
            assert step["world"] == 2 and step["samples"] == 4 * 4  # four micro-batches of 4
            assert all(step["phases"].get(name, 0) > 0 for name in ("forward", "backward", "optimizer"))
            assert step["comm"]["busy"] > 0  # ZeRO-1's collectives
