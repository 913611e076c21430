"""Communication measured through the frameworks, with no code of the user's but the
callback: Lightning's ``ddp`` strategy and a Hugging Face ``Trainer`` under
``torch.distributed.run``; and FSDP (``fully_shard``) through the plain hook. CPU, gloo.

FSDP's older wrapper, ``FullyShardedDataParallel``, does not run on CPU: its constructor
refuses ("FSDP needs a non-CPU accelerator device, but no accelerator device is detected"),
and so does Lightning's ``fsdp`` strategy, which uses it; ``fully_shard`` does run on gloo.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumon.testing import AgentProcess
from tests.e2e.accuracy import Bound, judged, rows_of, within_clocks
from tests.e2e.distributed import AGENT, run_job, share_of

STEPS = 8


pytestmark = [pytest.mark.slow, AGENT]


def test_lightning_ddp_steps_carry_their_all_reduce(agent: AgentProcess, tmp_path: Path) -> None:
    job = run_job(agent, tmp_path, "framework_job.py", 2, ["lightning", "--steps", str(STEPS)],
                  run="lightning-ddp", expect_steps=2 * STEPS)
    for rank in (0, 1):
        summary, steps = job.summary(rank), job.steps(rank)
        assert summary["strategy"] == "DDPStrategy"
        for step in steps:
            count, size, _ = step["comm"]["ops"]["all_reduce"]
            assert size == summary["grad_bytes"] and count >= 1
        assert share_of(job.verdicts(rank), "communication") >= 0.8
    # 64 MiB all-reduced for every 2-sample batch: most of the step waits for it (N: 0), not
    # the forward and backward work (A: the whole step). The first step also waits for the
    # ranks to meet. Between the bounds lies the run delay (contention, exposed by right):
    # B (little overlaps) and U may fall inside it.
    judged([Bound("within the job's clocks", within_clocks(cpu_in_comm=True), fails="NA", either="BU")],
           rows_of(job, 0) + rows_of(job, 1))


def test_hf_trainer_under_torchrun_steps_carry_their_all_reduce(
    agent: AgentProcess, tmp_path: Path
) -> None:
    job = run_job(agent, tmp_path, "framework_job.py", 2, ["hf", "--steps", str(STEPS)],
                  run="hf-ddp", expect_steps=2 * STEPS)
    for rank in (0, 1):
        summary, steps = job.summary(rank), job.steps(rank)
        assert summary["wrapped"] == "DistributedDataParallel"
        for step in steps:
            # Two micro-batches a step: Accelerate skips the first one's all-reduce (no_sync).
            count, size, _ = step["comm"]["ops"]["all_reduce"]
            assert size == summary["grad_bytes"] and count >= 1
            assert 0 < step["comm"]["exposed"] <= step["comm"]["busy"] <= step["duration"]
    # The training thread waits for each step's all-reduce at least as long as its own clocks
    # say it was off a CPU (N: 0 fails), and at most the window's wall time less the
    # device-like work slept in each forward (A, all of the step, fails); the averaging and
    # DDP's copies are communication done on the training thread's CPU. B and U read within
    # the run delay of the truth on a model this small, and may pass.
    judged([Bound("within the job's clocks", within_clocks(cpu_in_comm=True), fails="NA", either="BU")],
           rows_of(job, 0) + rows_of(job, 1))


def test_fully_shard_steps_carry_their_all_gathers_and_reduce_scatters(
    agent: AgentProcess, tmp_path: Path
) -> None:
    job = run_job(agent, tmp_path, "framework_job.py", 2, ["fsdp", "--steps", str(STEPS)],
                  run="fsdp2", expect_steps=2 * STEPS)
    for rank in (0, 1):
        summary, steps = job.summary(rank), job.steps(rank)
        for step in steps:
            ops = step["comm"]["ops"]
            # Each layer's gradients reduce-scattered once, whole (the input is unsharded).
            assert ops["reduce_scatter"][1] == summary["grad_bytes"]
            # Parameters gathered before forward and again before backward (resharded between).
            assert ops["all_gather"][1] in (summary["grad_bytes"], 2 * summary["grad_bytes"])
            # Blocking collectives on gloo: all of their time held the training thread.
            assert step["comm"]["exposed"] == pytest.approx(step["comm"]["busy"], rel=0.05)
    # ... as long as its clocks show it waiting (N: 0), not through its work (A). Nothing
    # overlaps (B reads within 5 % of the product); U may fall inside the run delay.
    judged([Bound("within the job's clocks", within_clocks(cpu_in_comm=True), fails="NA", either="BU")],
           rows_of(job, 0) + rows_of(job, 1))
