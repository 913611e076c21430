"""Prometheus families for training steps, memory and ingest, from StepStore copies."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from gpumon.analysis.bottleneck import Bottleneck, Flag
from gpumon.analysis.stream import RankAnalysis
from gpumon.collectors.samples import ProcessSample
from gpumon.export.exposition import CounterFamily, GaugeFamily, HistogramFamily
from gpumon.steps import DURATION_BUCKETS_S, RankState

RANK_LABELS = ["run", "rank"]
# Rendered once: every rank's histogram and verdict families repeat them at each scrape.
_BUCKET_BOUNDS = tuple("+Inf" if b == float("inf") else repr(float(b))
                       for b in (*DURATION_BUCKETS_S, float("inf")))
_BOTTLENECKS = tuple((b, b.value) for b in Bottleneck)
_FLAGS = tuple((f, f.value) for f in Flag)


def step_families(ranks: list[RankState], records_total: dict[str, int],
                  dropped_total: dict[str, int], processes: dict[int, ProcessSample],
                  resolved_uuids: dict[tuple[str, int], str]) -> Iterator[Metric]:
    """Step, phase, memory and process families per (run, rank), and ingest counters.

    ``resolved_uuids`` holds the device UUID the agent attributed each rank to (by UUID,
    NVML process list or CUDA index); ``gpumon_rank_info{gpu}`` carries it, so ranks join
    GPU series on ``uuid`` even when their client reported only a CUDA index.
    """
    info = GaugeFamily(
        "gpumon_rank_info", "Identity of each reporting rank; gpu is the device UUID when the "
        "agent resolved it (join with gpumon_gpu_info on uuid), else what the client reported.",
        labels=[*RANK_LABELS, "world", "local_rank", "pid", "gpu"])
    steps = CounterFamily("gpumon_steps", "Training steps reported.", labels=RANK_LABELS)
    duration = HistogramFamily("gpumon_step_duration_seconds", "Wall time of each step.",
                               labels=RANK_LABELS)
    phases = CounterFamily("gpumon_step_phase_seconds",
                           "Time spent in each phase of the step (data, forward, backward, "
                           "comm, optimizer, other).", labels=[*RANK_LABELS, "phase"])
    samples = CounterFamily("gpumon_samples", "Samples processed.", labels=RANK_LABELS)
    tokens = CounterFamily("gpumon_tokens", "Tokens processed.", labels=RANK_LABELS)
    flops = CounterFamily("gpumon_step_flops", "Floating-point operations reported.",
                          labels=RANK_LABELS)
    last = GaugeFamily("gpumon_step_last_timestamp_seconds",
                       "Unix time the last step of this rank ended.", labels=RANK_LABELS)
    allocated = GaugeFamily("gpumon_torch_memory_allocated_bytes",
                            "PyTorch allocator: memory held by tensors.", labels=RANK_LABELS)
    reserved = GaugeFamily("gpumon_torch_memory_reserved_bytes",
                           "PyTorch allocator: memory reserved from the device.",
                           labels=RANK_LABELS)
    peak = GaugeFamily("gpumon_torch_memory_peak_bytes",
                       "PyTorch allocator: peak allocated memory during the last step.",
                       labels=RANK_LABELS)
    retries = CounterFamily("gpumon_torch_alloc_retries",
                            "PyTorch allocator retries after a failed cudaMalloc "
                            "(cache flushes: a sign of memory pressure).", labels=RANK_LABELS)
    ooms = CounterFamily("gpumon_torch_ooms", "Out-of-memory errors.", labels=RANK_LABELS)
    cpu = CounterFamily("gpumon_process_cpu_seconds",
                        "CPU time of the training process.", labels=RANK_LABELS)
    rss = GaugeFamily("gpumon_process_resident_memory_bytes",
                      "Resident memory of the training process.", labels=RANK_LABELS)
    for state in sorted(ranks, key=lambda s: (s.run, s.rank)):
        labels = [state.run, str(state.rank)]
        gpu = resolved_uuids.get((state.run, state.rank), _text(state.gpu_hint))
        info.add_metric([*labels, _text(state.world), _text(state.local_rank),
                         _text(state.pid), gpu], 1.0)
        steps.add_metric(labels, float(state.steps_total))
        buckets, cumulative = [], 0
        for bound, count in zip(_BUCKET_BOUNDS, state.duration_bucket_counts, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        duration.add_metric(labels, buckets, state.duration_sum_s)
        for phase, seconds in sorted(state.phase_seconds_total.items()):
            phases.add_metric([*labels, phase], seconds)
        samples.add_metric(labels, float(state.samples_total))
        tokens.add_metric(labels, float(state.tokens_total))
        flops.add_metric(labels, state.flops_total)
        if state.last_step_end_t is not None:
            last.add_metric(labels, state.last_step_end_t)
        for family, value in ((allocated, state.memory_allocated_bytes),
                              (reserved, state.memory_reserved_bytes),
                              (peak, state.memory_peak_bytes),
                              (retries, state.alloc_retries_total)):
            if value is not None:
                family.add_metric(labels, float(value))
        ooms.add_metric(labels, float(state.ooms_total))
        process = processes.get(state.pid) if state.pid is not None else None
        if process is not None:
            cpu.add_metric(labels, process.cpu_seconds_total)
            rss.add_metric(labels, float(process.resident_memory_bytes))
    yield from (info, steps, duration, phases, samples, tokens, flops, last,
                allocated, reserved, peak, retries, ooms, cpu, rss)
    records = CounterFamily("gpumon_ingest_records", "Records accepted, by kind.",
                            labels=["kind"])
    for kind, count in sorted(records_total.items()):
        records.add_metric([kind], float(count))
    dropped = CounterFamily("gpumon_ingest_dropped", "Records or datagrams dropped, by reason.",
                            labels=["reason"])
    for reason, count in sorted(dropped_total.items()):
        dropped.add_metric([reason], float(count))
    yield records
    yield dropped


def _text(value: object) -> str:
    return "" if value is None else str(value)


def analysis_families(analyses: list[RankAnalysis]) -> Iterator[Metric]:
    """Verdict, MFU and OOM-risk families per (run, rank)."""
    total = CounterFamily("gpumon_step_bottleneck",
                          "Steps classified under each bottleneck.",
                          labels=[*RANK_LABELS, "bottleneck"])
    current = GaugeFamily("gpumon_step_bottleneck",
                          "1 for the latest verdict's bottleneck, 0 for the others.",
                          labels=[*RANK_LABELS, "bottleneck"])
    confidence = GaugeFamily("gpumon_step_bottleneck_confidence",
                             "Confidence (0-1) of the latest verdict.", labels=RANK_LABELS)
    flags = GaugeFamily("gpumon_step_flag",
                        "1 while the latest verdict carries the flag "
                        "(memory_pressure, throttled, straggler).",
                        labels=[*RANK_LABELS, "flag"])
    mfu = GaugeFamily("gpumon_step_mfu_ratio",
                      "Model FLOPs utilisation of the latest analysed step.",
                      labels=RANK_LABELS)
    straggler = GaugeFamily("gpumon_rank_straggler_score",
                            "Run median compute time / this rank's (below 0.75: straggler).",
                            labels=RANK_LABELS)
    risk = GaugeFamily("gpumon_oom_risk_ratio",
                       "Composite out-of-memory risk, 0-1.", labels=RANK_LABELS)
    predicted = GaugeFamily("gpumon_oom_predicted_seconds",
                            "Seconds until per-step peak memory reaches capacity at the "
                            "current trend (absent when not growing).", labels=RANK_LABELS)
    headroom = GaugeFamily("gpumon_oom_headroom_bytes",
                           "Device memory left: capacity - max(NVML used, torch reserved).",
                           labels=RANK_LABELS)
    for analysis in sorted(analyses, key=lambda a: (a.run, a.rank)):
        labels = [analysis.run, str(analysis.rank)]
        for _, name in _BOTTLENECKS:
            total.add_metric([*labels, name], float(analysis.bottleneck_steps.get(name, 0)))
        verdict = analysis.verdict
        if verdict is not None:
            for bottleneck, name in _BOTTLENECKS:
                current.add_metric([*labels, name], 1.0 if verdict.primary is bottleneck else 0.0)
            confidence.add_metric(labels, verdict.confidence)
            for flag, name in _FLAGS:
                flags.add_metric([*labels, name], 1.0 if flag in verdict.flags else 0.0)
            if verdict.mfu is not None:
                mfu.add_metric(labels, verdict.mfu)
        if analysis.straggler_score is not None:
            straggler.add_metric(labels, analysis.straggler_score)
        oom = analysis.oom
        if oom is not None:
            risk.add_metric(labels, oom.risk_ratio)
            if oom.predicted_seconds is not None:
                predicted.add_metric(labels, oom.predicted_seconds)
            if oom.headroom_bytes is not None:
                headroom.add_metric(labels, float(oom.headroom_bytes))
    yield from (total, current, confidence, flags, mfu, straggler, risk, predicted, headroom)
