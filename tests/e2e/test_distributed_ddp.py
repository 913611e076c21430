"""Real DDP jobs (gloo, CPU, ``torch.distributed.run``) reporting to a real agent: what the
client measures of their communication, against what each job measures itself, and the
verdicts the agent's engine reaches on them (straggler flagged or not, its cause, whom its
peers wait on)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from gpumon.testing import AgentProcess
from tests.e2e.accuracy import Bound, judged, rows_of, within_clocks
from tests.e2e.distributed import (
    AGENT,
    exposed_share,
    flagged_share,
    run_job,
    share_of,
)

STRAGGLER_STEPS = 150
"""Steps of the jobs with a straggler: it is flagged once its slowness has persisted over 24
steps, and the shares below count every step, those before too."""


pytestmark = [pytest.mark.slow, AGENT]


@pytest.mark.parametrize("buckets", ["copied", "bucket-view"])
def test_watching_leaves_ddp_gradients_bit_for_bit_as_they_were(
    agent: AgentProcess, tmp_path: Path, buckets: str
) -> None:
    # Three ranks: averaging by dividing the sum, or scaling by 1/3 in another order, would
    # differ in the last bit; the watcher averages as DDP does, gradients copied into the
    # buckets or the buckets' views.
    args = ["--model", "small", "--steps", "3", "--warmup", "1"]
    if buckets == "bucket-view":
        args.append("--bucket-view")
    watched = run_job(agent, tmp_path, "ddp_job.py", 3, args, run=f"ddp-3-watched-{buckets}",
                      expect_steps=9)
    plain = run_job(agent, tmp_path, "ddp_job.py", 3, [*args, "--no-watch"],
                    run=f"ddp-3-plain-{buckets}", expect_steps=9)
    for rank in (0, 1, 2):
        assert watched.summary(rank)["grads_sha"] == plain.summary(rank)["grads_sha"]
    assert all("comm" in s for s in watched.steps()) and not any("comm" in s for s in plain.steps())


@pytest.mark.parametrize("order", ["hook-after-watch", "hook-before-watch"])
def test_a_user_comm_hook_keeps_its_gradients_and_is_measured(
    agent: AgentProcess, tmp_path: Path, order: str
) -> None:
    args = ["--steps", "4", "--warmup", "1", "--comm-hook", "fp16"]
    if order == "hook-before-watch":
        args.append("--hook-before-watch")
    watched = run_job(agent, tmp_path, "ddp_job.py", 2, args, run=f"fp16-{order}", expect_steps=8)
    plain = run_job(agent, tmp_path, "ddp_job.py", 2, [*args, "--no-watch"],
                    run=f"fp16-plain-{order}", expect_steps=8)
    for rank in (0, 1):
        summary = watched.summary(rank)
        assert summary["comm_hook"] == "fp16_compress_hook"
        assert summary["grads_sha"] == plain.summary(rank)["grads_sha"]  # bit for bit
        for step in watched.steps(rank):
            count, size, _ = step["comm"]["ops"]["all_reduce"]
            assert size == summary["grad_bytes"] // 2  # what fp16 compression sends
            assert step["comm"]["exposed"] > 0
        assert all("comm" not in step for step in plain.steps(rank))


def test_a_rank_with_more_forward_work_waits_least(
    agent: AgentProcess, tmp_path: Path
) -> None:
    job = run_job(agent, tmp_path, "ddp_job.py", 4,
                  ["--model", "small", "--steps", str(STRAGGLER_STEPS), "--slow-rank", "3",
                   "--slow-forward-ms", "60"], run="ddp-slow-forward",
                  expect_steps=4 * STRAGGLER_STEPS)
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for step in job.steps():
        by_step.setdefault(step["step"], {})[step["rank"]] = step
    least_waiting = [min(ranks, key=lambda r: ranks[r]["comm"]["exposed"]) for ranks in by_step.values()]
    assert least_waiting.count(3) >= 0.8 * len(least_waiting), least_waiting
    # Its peers wait for its extra 60 ms inside backward, as long as their own clocks show
    # them waiting (N: 0), and it waits for none of it (A: its 60 ms of device-like work in
    # forward). Four ranks share two cores here, so the band is as wide as their run delay in
    # backward: B (little overlaps: one bucket) and U are not reliably told apart; the delay
    # and overlap tests (test_ddp_accuracy) are where they are.
    judged([Bound("waits within the job's clocks", within_clocks(), fails="NA", either="BU")],
           [row for rank in range(4) for row in rows_of(job, rank)])
    # The agent's verdicts, on all of its steps.
    slow = job.verdicts(3)
    assert flagged_share(slow) >= 0.8
    assert {v.straggler_cause.value for v in slow if v.straggler_cause is not None} == {"compute"}
    for rank in (0, 1, 2):
        peer = job.verdicts(rank)
        assert flagged_share(peer) <= 0.05
        assert share_of(peer, "communication") >= 0.8
        # Told whom they wait on once the straggler is flagged (not before it persisted).
        assert {v.slower_rank for v in peer if v.slower_rank is not None} == {3}
        assert sum(v.slower_rank == 3 for v in peer) >= 0.8 * len(peer)


def test_a_rank_with_a_slow_input_pipeline_makes_its_peer_wait(
    agent: AgentProcess, tmp_path: Path
) -> None:
    job = run_job(agent, tmp_path, "ddp_job.py", 2,
                  ["--model", "small", "--steps", str(STRAGGLER_STEPS), "--slow-rank", "1",
                   "--slow-input-ms", "60"], run="ddp-slow-input",
                  expect_steps=2 * STRAGGLER_STEPS)
    slow, peer = job.steps(1), job.steps(0)
    # The data phase is the time the job's own generator took to make the batch (a 60 ms
    # sleep, then the batch), read around it: never less, and in the median within 2 ms.
    made = job.summary(1)["data_s"]
    overhead = [s["phases"]["data"] - truth for s, truth in zip(slow, made, strict=True)]
    assert min(overhead) >= 0 and statistics.median(overhead) <= 0.002, overhead
    assert statistics.median(made) >= 0.06
    assert exposed_share(peer) > exposed_share(slow) + 0.15
    # The peer waits for those 60 ms, as long as its clocks show it waiting (N: 0), and the
    # slow rank waits for none of its input (A: its 60 ms of data). The band is the run delay
    # in backward, wide enough on two shared cores that B (one bucket: nothing overlaps) and
    # U are not reliably told apart (a quiet run told U apart: 46 ms against [63, 68]).
    judged([Bound("waits within the job's clocks", within_clocks(), fails="NA", either="BU")],
           rows_of(job, 0) + rows_of(job, 1))
    slow_verdicts, peer_verdicts = job.verdicts(1), job.verdicts(0)
    assert flagged_share(slow_verdicts) >= 0.8 and share_of(slow_verdicts, "input") >= 0.8
    assert {v.straggler_cause.value for v in slow_verdicts if v.straggler_cause is not None} == {"input"}
    assert flagged_share(peer_verdicts) <= 0.05 and share_of(peer_verdicts, "communication") >= 0.8
    assert sum(v.slower_rank == 1 for v in peer_verdicts) >= 0.8 * len(peer_verdicts)


def test_a_rank_sharing_its_core_is_a_host_straggler(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """Each rank pinned to a core of its own, rank 1's shared with a process that only spins
    and outweighs it (rank 1 runs niced): rank 1 has no more work than rank 0, its training
    thread waits for its core, whatever else the host runs. The job's
    own truth: its training threads' CPU time per step (the work) and their run delay (the
    wait), which each rank reads from the kernel itself."""
    job = run_job(agent, tmp_path, "ddp_job.py", 2,
                  ["--model", "small", "--batch", "4096", "--steps", str(STRAGGLER_STEPS),
                   "--hog-rank", "1"],
                  run="ddp-shared-core", expect_steps=2 * STRAGGLER_STEPS)
    truth = {rank: statistics.median(job.summary(rank)["cpu_wait_s"]) for rank in (0, 1)}
    cpu = {rank: statistics.median(job.summary(rank)["thread_cpu_s"]) for rank in (0, 1)}
    assert truth[1] > truth[0] + 0.001 and truth[1] > cpu[1] / 2, (truth, cpu)  # as built
    for rank in (0, 1):  # gpumon's reading is the job's
        measured = statistics.median(s["cpu_wait"] for s in job.steps(rank))
        assert abs(measured - truth[rank]) <= 0.001 + 0.25 * truth[rank], (rank, measured, truth)
    slow, peer = job.verdicts(1), job.verdicts(0)
    assert flagged_share(slow) >= 0.8, slow
    assert {v.straggler_cause.value for v in slow if v.straggler_cause is not None} == {"host"}
    assert flagged_share(peer) <= 0.05
    assert sum(v.slower_rank == 1 for v in peer) >= 0.8 * len(peer)


def test_a_balanced_job_flags_a_rank_only_where_its_own_clocks_show_it_slower(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """Two ranks doing the same work on a host with more runnable threads than cores. One
    rank's own work (step less its collective wait) often runs 1.3x the other's for seconds
    at a time and then the other's does: those episodes are not flagged. Sometimes one rank
    stays slower through a whole window, and is what its peer waits for: measured under load,
    86 ms of own work a step against 60, its training thread burning 79 ms of CPU against 63
    for the same work (a shared virtual CPU) and waiting 44 ms for a core against 42. Then
    it may be flagged, but only where the job's own clocks, read by each rank independently
    of gpumon, show it slower: its thread's CPU time plus its run delay above its peer's by
    at least half the extra gpumon measured, with the cause the larger part names."""
    steps = 40
    job = run_job(agent, tmp_path, "ddp_job.py", 2, ["--steps", str(steps)],
                  run="ddp-balanced", expect_steps=2 * steps)
    cpu = {r: statistics.median(job.summary(r)["thread_cpu_s"]) for r in (0, 1)}
    wait = {r: statistics.median(job.summary(r)["cpu_wait_s"]) for r in (0, 1)}
    own = {r: statistics.median(s["duration"] - s["comm"]["exposed"] for s in job.steps(r))
           for r in (0, 1)}
    figures = {"cpu": cpu, "wait": wait, "own": own}
    for rank in (0, 1):
        peer = 1 - rank
        verdicts = job.verdicts(rank)
        assert len(verdicts) == steps
        causes = {v.straggler_cause.value for v in verdicts
                  if any(f.value == "straggler" for f in v.flags) and v.straggler_cause}
        if flagged_share(verdicts) <= 0.05:
            continue
        assert sum(v.slower_rank == rank for v in job.verdicts(peer)) > 0, figures
        extra_truth = cpu[rank] + wait[rank] - cpu[peer] - wait[peer]
        assert extra_truth >= 0.5 * (own[rank] - own[peer]) > 0, (rank, figures)
        assert causes <= {"host", "compute"}, (rank, causes, figures)
        if "host" in causes:
            assert wait[rank] > wait[peer], (rank, causes, figures)
        if "compute" in causes:
            assert cpu[rank] > cpu[peer], (rank, causes, figures)
    # No rank was named as the one waited on without being flagged itself.
    for rank in (0, 1):
        named = {v.slower_rank for v in job.verdicts(rank) if v.slower_rank is not None}
        assert all(flagged_share(job.verdicts(r)) > 0 for r in named), (rank, named)
