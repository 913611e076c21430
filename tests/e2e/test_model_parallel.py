"""Model-parallel jobs, unmodified, under ``gpumon run`` against a real agent, beside what the
jobs measure themselves.

- ``torch.distributed.pipelining`` (``jobs/pipeline_job.py``): GPipe, 1F1B and interleaved
  1F1B schedules on 2 ranks, and 1F1B on 4, each stage with its own known device-like work, so
  that the light stages wait for the heavy ones. Each rank's bubble (its receive waits) is held
  to the job's own truth, the step less its own work; the layout comes from the stages; the
  comparison of each rank with its replicas (none here) flags no stage as a straggler; the
  light stages read ``communication`` with a pipeline hint; the agent names the imbalance.
- DTensor tensor parallelism (``jobs/tensor_parallel_job.py``): its functional all-reduces
  counted and sized as torch's ``CommDebugMode`` counts them; on a 2 x 2 data x tensor mesh
  with FSDP2, FSDP2's all-gathers and reduce-scatters too, and each rank's coordinates.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from gpumon.testing import AgentProcess, scrape_metrics, value, values
from tests.e2e.distributed import AGENT, JOBS, Job, run_job, share_of, watched

pytestmark = [pytest.mark.slow, AGENT]

WARMUP = 5  # steps the schedule takes to settle (first compile of its actions, first hello)


def pipeline(agent: AgentProcess, tmp_path: Path, run: str, ranks: int, schedule: str,
             work_ms: list[int], steps: int = 30) -> Job:
    return watched(agent, tmp_path, run,
                   [str(JOBS / "pipeline_job.py"), "--out", str(tmp_path / run), "--schedule",
                    schedule, "--work-ms", ",".join(map(str, work_ms)), "--steps", str(steps)],
                   expect_steps=ranks * steps, torchrun=ranks)


def truths(job: Job, rank: int) -> list[dict[str, Any]]:
    """The rank's own timing of each step, from ``WARMUP`` on: ``blocked`` is the step less
    its device-like work and its thread's CPU time (``jobs/pipeline_job.py``): the time it
    waited, which no gpumon figure went into."""
    steps: list[dict[str, Any]] = job.summary(rank)["steps"]
    return steps[WARMUP:]


def bubbles(job: Job, rank: int) -> list[float]:
    return [s["comm"]["bubble"] for s in job.steps(rank)[WARMUP:]]


CASES = [
    # (run, ranks, schedule, device-like forward work per micro-batch per stage, in ms)
    ("pp-gpipe", 2, "gpipe", [4, 10]),
    ("pp-1f1b", 2, "1f1b", [4, 10]),
    ("pp-interleaved", 2, "interleaved", [3, 8, 3, 8]),  # rank 0 holds stages 0 and 2
    ("pp-1f1b-4", 4, "1f1b", [4, 4, 4, 12]),
]


@pytest.mark.parametrize(("run", "ranks", "schedule", "work_ms"), CASES,
                         ids=[case[0] for case in CASES])
def test_a_pipelines_bubble_is_its_stages_wait_for_their_neighbours(
        agent: AgentProcess, tmp_path: Path, run: str, ranks: int, schedule: str,
        work_ms: list[int]) -> None:
    job = pipeline(agent, tmp_path, run, ranks, schedule, work_ms)
    for rank in range(ranks):
        truth = statistics.fmean(s["blocked"] for s in truths(job, rank))
        step = statistics.fmean(s["duration"] for s in truths(job, rank))
        measured = statistics.fmean(bubbles(job, rank))
        exposed = statistics.fmean(s["comm"]["exposed"] for s in job.steps(rank)[WARMUP:])
        for record in job.steps(rank):
            ops = record["comm"]["ops"]
            assert "send" in ops or "recv" in ops
            assert record["comm"]["bubble"] <= record["comm"]["exposed"] + 1e-9
        if truth >= 0.2 * step:  # a stage that mostly waits: its wait is the bubble
            assert abs(measured - truth) <= 0.3 * truth, (rank, measured, truth)
            assert abs(exposed - truth) <= 0.3 * truth, (rank, exposed, truth)
            assert share_of(job.verdicts(rank)[WARMUP:], "communication") >= 0.8
            assert all("pipeline stage" in v.hint for v in job.verdicts(rank)[WARMUP:]
                       if v.primary.value == "communication")
        else:  # the stage the others wait for: it waits little, and never more than it did
            # (its exposed time may hold more: its device-like work is a sleep, off a CPU
            # while its sends are in flight, which the host ledger counts as contention)
            assert measured <= truth + 0.003, (rank, measured, truth)
    metrics = scrape_metrics(agent)
    stages = {}
    for rank in range(ranks):
        assert value(metrics, "gpumon_rank_parallel_info", run=run, rank=str(rank),
                     pp=str(rank), dp="", tp="", ep="", cp="") == 1
        assert value(metrics, "gpumon_pipeline_bubble_seconds_total", run=run,
                     rank=str(rank)) == pytest.approx(
            sum(s["comm"]["bubble"] for s in job.steps(rank)))
        # No rank has a replica: nothing to compare it with, so no score and no straggler.
        assert not values(metrics, "gpumon_rank_straggler_score", run=run, rank=str(rank))
        assert value(metrics, "gpumon_step_flag", run=run, rank=str(rank),
                     flag="straggler") == 0
        stages[rank] = value(metrics, "gpumon_pipeline_stage_own_seconds", run=run,
                             pp=str(rank))
    heaviest = max(stages, key=lambda r: stages[r])
    per_rank_work = [sum(work_ms[i] for i in range(len(work_ms)) if i % ranks == r)
                     for r in range(ranks)]
    assert heaviest == per_rank_work.index(max(per_rank_work))
    assert value(metrics, "gpumon_pipeline_stage_imbalance_ratio", run=run) == pytest.approx(
        max(stages.values()) / statistics.fmean(stages.values()))


def test_tensor_parallel_collectives_are_those_comm_debug_mode_counts(
        agent: AgentProcess, tmp_path: Path) -> None:
    steps = 20
    job = watched(agent, tmp_path, "tp", [str(JOBS / "tensor_parallel_job.py"), "--out",
                                          str(tmp_path / "tp"), "--steps", str(steps)],
                  expect_steps=2 * (steps + 1), torchrun=2)
    for rank in (0, 1):
        truth = job.summary(rank)
        assert truth["counts"] == {"all_reduce": 3}  # the job's own count, per step
        for record in job.steps(rank)[1:]:
            count, size, _ = record["comm"]["ops"]["all_reduce"]
            assert abs(count - truth["counts"]["all_reduce"]) <= 0.1 * truth["counts"]["all_reduce"]
            assert abs(size - truth["bytes"]["all_reduce"]) <= 0.1 * truth["bytes"]["all_reduce"]
    metrics = scrape_metrics(agent)
    for rank in (0, 1):
        assert value(metrics, "gpumon_rank_parallel_info", run="tp", rank=str(rank),
                     tp=str(rank), dp="", pp="", ep="", cp="") == 1


def test_a_data_by_tensor_mesh_measures_both_and_knows_each_ranks_place(
        agent: AgentProcess, tmp_path: Path) -> None:
    """A 2 x 2 mesh ("dp", "tp"): DTensor's all-reduces over tp, FSDP2's all-gathers and
    reduce-scatters over dp, each as many as ``CommDebugMode`` counts; each rank's (dp, tp)."""
    steps = 8
    job = watched(agent, tmp_path, "dp-tp", [str(JOBS / "tensor_parallel_job.py"), "--out",
                                             str(tmp_path / "dp-tp"), "--steps", str(steps),
                                             "--dp", "2"],
                  expect_steps=4 * (steps + 1), torchrun=4)
    names = {"all_reduce": "all_reduce", "_allgather_base_": "all_gather",
             "_reduce_scatter_base_": "reduce_scatter"}
    metrics = scrape_metrics(agent)
    for rank in range(4):
        truth = job.summary(rank)
        expected = {names[op]: count for op, count in truth["counts"].items()}
        assert set(expected) == {"all_reduce", "all_gather", "reduce_scatter"}
        last = job.steps(rank)[-1]  # the step CommDebugMode watched
        assert {op: figures[0] for op, figures in last["comm"]["ops"].items()} == expected
        dp, tp = truth["coordinate"]
        assert value(metrics, "gpumon_rank_parallel_info", run="dp-tp", rank=str(rank),
                     dp=str(dp), tp=str(tp), pp="", ep="", cp="") == 1


@pytest.mark.parametrize("how", ["gpumon-run", "watch-engine"])
def test_deepspeeds_pipeline_engine_is_one_step_a_batch_with_its_transfers(
        agent: AgentProcess, tmp_path: Path, how: str) -> None:
    """A DeepSpeed ``PipelineModule`` in 2 stages trained with ``train_batch`` (4 micro-batches,
    stage 1 ten times stage 0's device-like work), under ``gpumon run`` or with
    ``mon.watch(engine)`` alone: one step per ``train_batch``, its pipe transfers and reductions
    measured, stage 0's bubble its own blocked time, each rank's stage from the engine's grid."""
    steps = 12
    args = ["--steps", str(steps), "--work-ms", "12"]
    if how == "gpumon-run":
        job = watched(agent, tmp_path, "ds-pipe", [str(JOBS / "deepspeed_pipe_job.py"), "--out",
                                                   str(tmp_path / "ds-pipe"), *args],
                      expect_steps=2 * steps, torchrun=2)
    else:
        job = run_job(agent, tmp_path, "deepspeed_pipe_job.py", 2, [*args, "--hooked"],
                      "ds-pipe", expect_steps=2 * steps)
    metrics = scrape_metrics(agent)
    for rank in (0, 1):
        truth = job.summary(rank)
        records = job.steps(rank)
        assert len(records) == steps  # one a train_batch
        for record in records:
            assert record["comm"]["ops"]["send"][0] >= 1 and "recv" in record["comm"]["ops"]
            assert "all_reduce" in record["comm"]["ops"]
            if how == "watch-engine":  # (gpumon run counts a DataLoader's batches: none here)
                assert record["samples"] == 32  # 4 micro-batches of 8
        assert value(metrics, "gpumon_rank_parallel_info", run="ds-pipe", rank=str(rank),
                     pp=str(truth["stage"]), dp=str(truth["dp"]), tp="", ep="", cp="") == 1
    waits = [s["bubble"] for s in job.summary(0)["steps"][2:]]  # the step less its sleeps
    measured = [s["comm"]["bubble"] for s in job.steps(0)[2:]]
    assert abs(statistics.fmean(measured) - statistics.fmean(waits)) \
        <= 0.3 * statistics.fmean(waits)


def test_a_pipeline_with_fsdp_inside_each_stage_keeps_both_measured(
        agent: AgentProcess, tmp_path: Path) -> None:
    """Two stages, each sharded over two replicas with FSDP2, on a ("pp", "dp") mesh: every
    rank's steps carry the pipeline's transfers and FSDP's all-gathers and reduce-scatters; its
    coordinates come from the mesh; each rank is compared with its replica, so none is a
    straggler and every one has a score, while the light stage's bubble is named."""
    steps = 16
    job = watched(agent, tmp_path, "pp-fsdp",
                  [str(JOBS / "pipeline_job.py"), "--out", str(tmp_path / "pp-fsdp"),
                   "--schedule", "1f1b", "--work-ms", "4,12", "--steps", str(steps),
                   "--dp", "2"],
                  expect_steps=4 * steps, torchrun=4)
    metrics = scrape_metrics(agent)
    for rank in range(4):
        truth = job.summary(rank)
        for record in job.steps(rank)[1:]:
            ops = record["comm"]["ops"]
            assert {"send", "recv", "all_gather", "reduce_scatter"} <= set(ops), ops
        assert value(metrics, "gpumon_rank_parallel_info", run="pp-fsdp", rank=str(rank),
                     pp=str(truth["pp"]), dp=str(truth["dp"]), tp="", ep="", cp="") == 1
        assert value(metrics, "gpumon_rank_straggler_score", run="pp-fsdp", rank=str(rank)) \
            == pytest.approx(1.0, abs=0.25)
        assert value(metrics, "gpumon_step_flag", run="pp-fsdp", rank=str(rank),
                     flag="straggler") == 0
        if truth["pp"] == 0:  # the light stage waits for the heavy one
            measured = statistics.fmean(bubbles(job, rank))
            waited = statistics.fmean(s["blocked"] for s in truths(job, rank))
            assert measured > 0.2 * statistics.fmean(s["duration"] for s in truths(job, rank))
            assert measured <= waited * 1.3
