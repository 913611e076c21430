"""Prometheus families for training steps, memory, communication and ingest, from RankStore copies
(each rank's totals and the analysis it carried).

Nearly all of a scrape's series are per rank. They are rendered as text in one block per run,
kept with the versions of the states they came from (``RankTotals.version``,
``RankAnalysis.version``), and a run is rendered again only when one of its ranks has changed.
A run rather than a rank, because a run's ranks step together: blocks per rank made a scrape in
which every rank had changed slower, and at a 15 s scrape interval that is every scrape
(benchmarks/RESULTS.md, "Figures behind internal choices").
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client.core import Metric

from gpumon.analysis.bottleneck import Bottleneck, Flag
from gpumon.analysis.straggler import StragglerCause
from gpumon.analysis.stream import RankAnalysis, RankKey
from gpumon.analysis.thresholds import DEFAULT
from gpumon.collectors.samples import OWNER_LABELS, Owner, ProcessSample
from gpumon.export.exposition import CounterFamily, GaugeFamily, HistogramFamily, RenderCache
from gpumon.state.collectives import BANDWIDTH_STEPS
from gpumon.state.owners import Ownership
from gpumon.state.rank_totals import DURATION_BUCKETS_S, RankTotals
from gpumon.wire import PARALLEL_DIMS

RANK_LABELS = ["run", "rank"]
# Rendered once: every rank's histogram and verdict families repeat them at each scrape.
_BUCKET_BOUNDS = tuple("+Inf" if b == float("inf") else repr(float(b))
                       for b in (*DURATION_BUCKETS_S, float("inf")))
_BOTTLENECKS = tuple((b, b.value) for b in Bottleneck)
_FLAGS = tuple((f, f.value) for f in Flag)
_CAUSES = tuple((c, c.value) for c in StragglerCause)

RankSource = tuple[RankTotals, ProcessSample | None, str, Owner]
"""A rank's state, its process's sample, the device it runs on (``gpumon_rank_info{gpu}``) and
whose it is (the owner labels of ``gpumon_rank_info``)."""


class StepFamilies:
    """The step, memory, verdict and ingest families, rendering again only the runs that
    changed since the previous scrape (one instance per agent; safe for concurrent scrapes)."""

    def __init__(self) -> None:
        self._steps = RenderCache(_step_families, _add_steps)
        self._comm = RenderCache(_comm_families, _add_comm)
        self._analyses = RenderCache(_analysis_families, _add_analyses)
        self._stragglers = RenderCache(_straggler_families, _add_stragglers)

    def steps(self, ranks: list[RankTotals], records_total: dict[str, int],
              dropped_total: dict[str, int], processes: dict[int, ProcessSample],
              resolved_uuids: dict[RankKey, str],
              ownership: Ownership | None = None) -> Iterator[Metric]:
        """Step, phase, memory and process families per (run, rank), and ingest counters.

        ``resolved_uuids`` holds the device UUID the agent attributed each rank to (by UUID,
        NVML process list or CUDA index); ``gpumon_rank_info{gpu}`` carries it, so ranks join
        GPU series on ``uuid`` even when their client reported only a CUDA index.
        ``ownership`` says whose each rank's process is (by the pid the kernel gave).
        """
        ownership = ownership or Ownership()
        runs: dict[str, list[RankSource]] = {}
        for state in sorted(ranks, key=lambda s: (s.run, s.rank)):
            process = processes.get(state.pid) if state.pid is not None else None
            gpu = resolved_uuids.get((state.run, state.rank), _text(state.gpu_hint))
            owner = ownership.of_pid(state.kernel_pid)
            runs.setdefault(state.run, []).append((state, process, gpu, owner))
        # Versions are unique to a state, so they also say which ranks there are. A process
        # sample is a new object each host cycle; equal readings render the same (they are
        # non-negative: never -0.0 beside 0.0, nor NaN).
        keyed = [(run, tuple((s.version, process, gpu, owner)
                             for s, process, gpu, owner in sources), sources)
                 for run, sources in runs.items()]
        yield from self._steps.families(keyed)
        yield from self._comm.families(keyed)
        records = CounterFamily("gpumon_ingest_records", "Records accepted, by kind.",
                                labels=["kind"])
        for kind, count in sorted(records_total.items()):
            records.add_metric([kind], float(count))
        dropped = CounterFamily("gpumon_ingest_dropped",
                                "Records or datagrams dropped, by reason.", labels=["reason"])
        for reason, count in sorted(dropped_total.items()):
            dropped.add_metric([reason], float(count))
        yield records
        yield dropped

    def analyses(self, ranks: list[RankTotals]) -> Iterator[Metric]:
        """Verdict, MFU and OOM-risk families per (run, rank) the analyzer has said anything of."""
        runs: dict[str, list[RankAnalysis]] = {}
        for state in sorted(ranks, key=lambda s: (s.run, s.rank)):
            if state.analysis is not None:
                runs.setdefault(state.run, []).append(state.analysis)
        keyed = [(run, tuple(a.version for a in sources), sources) for run, sources in runs.items()]
        yield from self._analyses.families(keyed)
        yield from self._stragglers.families(keyed)

    def runs_held(self) -> tuple[int, int]:
        """Runs whose rendered series are held: (step families, analysis families)."""
        return len(self._steps), len(self._analyses)


class _StepFamilySet(NamedTuple):
    info: GaugeFamily
    steps: CounterFamily
    duration: HistogramFamily
    phases: CounterFamily
    samples: CounterFamily
    tokens: CounterFamily
    flops: CounterFamily
    last: GaugeFamily
    allocated: GaugeFamily
    reserved: GaugeFamily
    peak: GaugeFamily
    retries: CounterFamily
    ooms: CounterFamily
    cpu: CounterFamily
    rss: GaugeFamily
    framework: GaugeFamily
    parallel: GaugeFamily


def _step_families() -> _StepFamilySet:
    return _StepFamilySet(
        GaugeFamily(
            "gpumon_rank_info", "Identity of each reporting rank; gpu is the device UUID when "
            "the agent resolved it (join with gpumon_gpu_info on uuid), else what the client "
            "reported; node, pod, namespace, container, slurm_job, slurm_step and user say "
            "whose it is, as the agent verified them (empty where unknown).",
            labels=[*RANK_LABELS, "world", "local_rank", "pid", "gpu", *OWNER_LABELS]),
        CounterFamily("gpumon_steps", "Training steps reported.", labels=RANK_LABELS),
        HistogramFamily("gpumon_step_duration_seconds", "Wall time of each step.",
                        labels=RANK_LABELS),
        CounterFamily("gpumon_step_phase_seconds",
                      "Time spent in each phase of the step (data, forward, backward, "
                      "comm, optimizer, other).", labels=[*RANK_LABELS, "phase"]),
        CounterFamily("gpumon_samples", "Samples processed.", labels=RANK_LABELS),
        CounterFamily("gpumon_tokens", "Tokens processed.", labels=RANK_LABELS),
        CounterFamily("gpumon_step_flops", "Floating-point operations reported.",
                      labels=RANK_LABELS),
        GaugeFamily("gpumon_step_last_timestamp_seconds",
                    "Unix time the last step of this rank ended.", labels=RANK_LABELS),
        GaugeFamily("gpumon_torch_memory_allocated_bytes",
                    "PyTorch allocator: memory held by tensors.", labels=RANK_LABELS),
        GaugeFamily("gpumon_torch_memory_reserved_bytes",
                    "PyTorch allocator: memory reserved from the device.", labels=RANK_LABELS),
        GaugeFamily("gpumon_torch_memory_peak_bytes",
                    "PyTorch allocator: peak allocated memory since the previous reading "
                    "(the last step; with CUDA, the steps of the last 50 ms when shorter).",
                    labels=RANK_LABELS),
        CounterFamily("gpumon_torch_alloc_retries",
                      "PyTorch allocator retries after a failed cudaMalloc "
                      "(cache flushes: a sign of memory pressure).", labels=RANK_LABELS),
        CounterFamily("gpumon_torch_ooms", "Out-of-memory errors.", labels=RANK_LABELS),
        CounterFamily("gpumon_process_cpu_seconds",
                      "CPU time of the training process.", labels=RANK_LABELS),
        GaugeFamily("gpumon_process_resident_memory_bytes",
                    "Resident memory of the training process.", labels=RANK_LABELS),
        GaugeFamily("gpumon_rank_framework_info",
                    "What drives each rank's loop, where a watcher found it (deepspeed), and "
                    "the ZeRO stage it runs (0-3; empty when none).",
                    labels=[*RANK_LABELS, "framework", "zero_stage"]),
        GaugeFamily("gpumon_rank_parallel_info",
                    "Each rank's index along each dimension of its job's parallelism (data, "
                    "tensor, pipeline, expert, context; empty where the job has none), where "
                    "its hook found it.", labels=[*RANK_LABELS, *PARALLEL_DIMS]),
    )


def _add_steps(families: _StepFamilySet, ranks: list[RankSource]) -> None:
    for state, process, gpu, owner in ranks:
        _add_rank_steps(families, state, process, gpu, owner)


def _add_rank_steps(f: _StepFamilySet, state: RankTotals, process: ProcessSample | None,
                    gpu: str, owner: Owner) -> None:
    labels = [state.run, str(state.rank)]
    f.info.add_metric([*labels, _text(state.world), _text(state.local_rank),
                       _text(state.pid), gpu, *owner.labels()], 1.0)
    f.steps.add_metric(labels, float(state.steps_total))
    buckets, cumulative = [], 0
    for bound, count in zip(_BUCKET_BOUNDS, state.duration_bucket_counts, strict=True):
        cumulative += count
        buckets.append((bound, float(cumulative)))
    f.duration.add_metric(labels, buckets, state.duration_sum_s)
    for phase, seconds in sorted(state.phase_seconds_total.items()):
        f.phases.add_metric([*labels, phase], seconds)
    f.samples.add_metric(labels, float(state.samples_total))
    f.tokens.add_metric(labels, float(state.tokens_total))
    f.flops.add_metric(labels, state.flops_total)
    if state.last_step_end_t is not None:
        f.last.add_metric(labels, state.last_step_end_t)
    for family, value in ((f.allocated, state.memory_allocated_bytes),
                          (f.reserved, state.memory_reserved_bytes),
                          (f.peak, state.memory_peak_bytes),
                          (f.retries, state.alloc_retries_total)):
        if value is not None:
            family.add_metric(labels, float(value))
    f.ooms.add_metric(labels, float(state.ooms_total))
    if state.framework is not None:
        f.framework.add_metric([*labels, state.framework, _text(state.zero_stage)], 1.0)
    if state.parallel is not None:
        f.parallel.add_metric(
            [*labels, *(_text(getattr(state.parallel, dim)) for dim in PARALLEL_DIMS)], 1.0)
    if process is not None:
        f.cpu.add_metric(labels, process.cpu_seconds_total)
        f.rss.add_metric(labels, float(process.resident_memory_bytes))


def _text(value: object) -> str:
    return "" if value is None else str(value)


class _AnalysisFamilySet(NamedTuple):
    total: CounterFamily
    current: GaugeFamily
    confidence: GaugeFamily
    flags: GaugeFamily
    mfu: GaugeFamily
    straggler: GaugeFamily
    risk: GaugeFamily
    predicted: GaugeFamily
    headroom: GaugeFamily


def _analysis_families() -> _AnalysisFamilySet:
    return _AnalysisFamilySet(
        CounterFamily("gpumon_step_bottleneck", "Steps classified under each bottleneck.",
                      labels=[*RANK_LABELS, "bottleneck"]),
        GaugeFamily("gpumon_step_bottleneck_current",
                    "1 for the latest verdict's bottleneck, 0 for the others.",
                    labels=[*RANK_LABELS, "bottleneck"]),
        GaugeFamily("gpumon_step_bottleneck_confidence",
                    "Confidence (0-1) of the latest verdict.", labels=RANK_LABELS),
        GaugeFamily("gpumon_step_flag",
                    "1 while the latest verdict carries the flag "
                    "(memory_pressure, throttled, straggler).", labels=[*RANK_LABELS, "flag"]),
        GaugeFamily("gpumon_step_mfu_ratio",
                    "Model FLOPs utilisation of the latest analysed step.", labels=RANK_LABELS),
        GaugeFamily("gpumon_rank_straggler_score",
                    "Mean own work per step (step time less collective wait) of the run's "
                    "other ranks on this node / this rank's (a straggler below the "
                    "straggler_score_max threshold, by default "
                    f"{DEFAULT.straggler_score_max}).",
                    labels=RANK_LABELS),
        GaugeFamily("gpumon_oom_risk_ratio",
                    "Composite out-of-memory risk, 0-1.", labels=RANK_LABELS),
        GaugeFamily("gpumon_oom_predicted_seconds",
                    "Seconds until per-step peak memory reaches capacity at the "
                    "current trend (absent when not growing).", labels=RANK_LABELS),
        GaugeFamily("gpumon_oom_headroom_bytes",
                    "Device memory left: capacity - max(NVML used, torch reserved).",
                    labels=RANK_LABELS),
    )


def _add_analyses(families: _AnalysisFamilySet, analyses: list[RankAnalysis]) -> None:
    for analysis in analyses:
        _add_rank_analysis(families, analysis)


def _add_rank_analysis(f: _AnalysisFamilySet, analysis: RankAnalysis) -> None:
    labels = [analysis.run, str(analysis.rank)]
    for _, name in _BOTTLENECKS:
        f.total.add_metric([*labels, name], float(analysis.bottleneck_steps.get(name, 0)))
    verdict = analysis.verdict
    if verdict is not None:
        for bottleneck, name in _BOTTLENECKS:
            f.current.add_metric([*labels, name], 1.0 if verdict.primary is bottleneck else 0.0)
        f.confidence.add_metric(labels, verdict.confidence)
        for flag, name in _FLAGS:
            f.flags.add_metric([*labels, name], 1.0 if flag in verdict.flags else 0.0)
        if verdict.mfu is not None:
            f.mfu.add_metric(labels, verdict.mfu)
    if analysis.straggler_score is not None:
        f.straggler.add_metric(labels, analysis.straggler_score)
    oom = analysis.oom
    if oom is not None:
        f.risk.add_metric(labels, oom.risk_ratio)
        if oom.predicted_seconds is not None:
            f.predicted.add_metric(labels, oom.predicted_seconds)
        if oom.headroom_bytes is not None:
            f.headroom.add_metric(labels, float(oom.headroom_bytes))


# --- communication, per rank (from RankTotals.comm) -----------------------------------------


class _CommFamilySet(NamedTuple):
    exposed: CounterFamily
    overlapped: CounterFamily
    operations: CounterFamily
    bytes: CounterFamily
    seconds: CounterFamily
    bus: GaugeFamily
    bubble: CounterFamily


def _comm_families() -> _CommFamilySet:
    op_labels = [*RANK_LABELS, "op"]
    return _CommFamilySet(
        CounterFamily("gpumon_comm_exposed_seconds",
                      "Time collectives held the training thread up: blocked on them, or kept "
                      "off a CPU by their threads (measured by watch(), or a hand-timed comm "
                      "phase when larger; never both added).",
                      labels=RANK_LABELS),
        CounterFamily("gpumon_comm_overlapped_seconds",
                      "Time collectives were in flight while the rank kept computing "
                      "(measured busy time beyond the exposed wait).", labels=RANK_LABELS),
        CounterFamily("gpumon_collective_operations", "Collectives run, by kind.",
                      labels=op_labels),
        CounterFamily("gpumon_collective_bytes", "Collective payload bytes, by kind.",
                      labels=op_labels),
        CounterFamily("gpumon_collective_seconds",
                      "Summed duration of collectives (launch to completion), by kind.",
                      labels=op_labels),
        GaugeFamily("gpumon_collective_bus_bandwidth_bytes_per_second",
                    f"Achieved bus bandwidth over the rank's last {BANDWIDTH_STEPS} steps that "
                    "ran the kind: "
                    "bytes / seconds x nccl-tests' factor (all-reduce 2(n-1)/n).",
                    labels=op_labels),
        CounterFamily("gpumon_pipeline_bubble_seconds",
                      "Of the exposed time, the time the training thread waited to receive "
                      "from another rank: a pipeline stage's bubble.", labels=RANK_LABELS),
    )


def _add_comm(f: _CommFamilySet, ranks: list[RankSource]) -> None:
    for state, _, _, _ in ranks:
        comm = state.comm
        if comm is None:
            continue
        labels = [state.run, str(state.rank)]
        f.exposed.add_metric(labels, comm.exposed_seconds)
        if not comm.measured:
            continue
        f.overlapped.add_metric(labels, comm.overlapped_seconds)
        for op, figures in sorted(comm.ops.items()):
            op_labels = [*labels, op]
            f.operations.add_metric(op_labels, float(figures.count))
            f.bytes.add_metric(op_labels, float(figures.bytes))
            f.seconds.add_metric(op_labels, figures.seconds)
            if figures.bus_bytes_per_second is not None:
                f.bus.add_metric(op_labels, figures.bus_bytes_per_second)
        if comm.bubble_seconds is not None:
            f.bubble.add_metric(labels, comm.bubble_seconds)


# --- the straggler comparison, per rank (from RankAnalysis) ---------------------------------


class _StragglerFamilySet(NamedTuple):
    cause: GaugeFamily
    world_changes: CounterFamily
    stage_own: GaugeFamily
    imbalance: GaugeFamily


def _straggler_families() -> _StragglerFamilySet:
    return _StragglerFamilySet(
        GaugeFamily("gpumon_rank_straggler_cause",
                    "1 for the cause of a straggler's slowness (input, host, compute, gpu, unknown), "
                    "0 for the others; all 0 on a rank that is not its run's straggler.",
                    labels=[*RANK_LABELS, "cause"]),
        CounterFamily("gpumon_rank_world_changes",
                      "Times the world size this rank reports changed (an elastic restart).",
                      labels=RANK_LABELS),
        GaugeFamily("gpumon_pipeline_stage_own_seconds",
                    "Own work per step (step time less collective wait) of each pipeline "
                    "stage, the mean over its ranks on this node.", labels=["run", "pp"]),
        GaugeFamily("gpumon_pipeline_stage_imbalance_ratio",
                    "The slowest pipeline stage's own work per step over the stages' mean, "
                    "over the stages with ranks on this node (1: balanced).", labels=["run"]),
    )


def _add_stragglers(f: _StragglerFamilySet, analyses: list[RankAnalysis]) -> None:
    for analysis in analyses:
        labels = [analysis.run, str(analysis.rank)]
        if analysis.straggler_score is not None:
            for member, name in _CAUSES:
                f.cause.add_metric([*labels, name],
                                   1.0 if analysis.straggler_cause is member else 0.0)
        f.world_changes.add_metric(labels, float(analysis.world_changes))
    stages = stage_own_work(analyses)
    if stages:
        run = analyses[0].run
        for stage, own in sorted(stages.items()):
            f.stage_own.add_metric([run, str(stage)], own)
        if len(stages) > 1 and (mean := statistics.fmean(stages.values())) > 0:
            f.imbalance.add_metric([run], max(stages.values()) / mean)


def stage_own_work(analyses: list[RankAnalysis]) -> dict[int, float]:
    """Each pipeline stage's own work per step, the mean over its ranks in ``analyses`` (of one
    run), of the ranks whose stage is known and that were compared."""
    by_stage: dict[int, list[float]] = {}
    for analysis in analyses:
        layout = analysis.parallel
        if layout is not None and layout.pp is not None and analysis.own_work_s is not None:
            by_stage.setdefault(layout.pp, []).append(analysis.own_work_s)
    return {stage: statistics.fmean(own) for stage, own in by_stage.items()}
