"""A run from a recording: its steps replayed through the verdict engine ``gpumon classify``
uses, then put into time bins with the GPU samples recorded beside them."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from pathlib import Path

from gpumon.analysis.bottleneck import Flag
from gpumon.analysis.comm import attributed_phases, bus_bandwidth_factor, overlapped_s, wait_s
from gpumon.analysis.oom import theil_sen
from gpumon.commands.classify import Recording, classify_recording, load_recording
from gpumon.report.model import (
    GPU_METRICS,
    LINK_METRICS,
    MEMORY_COMPONENTS,
    PHASES,
    Mean,
    Peak,
    ReportError,
    RunModel,
    bin_count,
)
from gpumon.wire import StepRecord

STALL_STEPS = 10
"""A gap between a rank's steps longer than this many typical steps (and ``STALL_MIN_S``) is
a stall, as the straggler rule leaves out a rank that far behind (docs/architecture.md §7)."""
STALL_MIN_S = 5.0
BIN_STEPS = 3
"""Steps (of the slowest tenth) a time bin spans at the finest."""
SKIPPED_SHOWN = 10
"""Skipped lines named by number; the rest are counted."""
TREND_STEPS = 200
"""The latest per-step peaks the OOM prediction fits its trend to."""


def runs_in(recording: Recording) -> Counter[str]:
    """Steps per run in a recording."""
    return Counter(step.run for step in recording.steps)


def choose_run(runs: Counter[str], run: str | None, where: str) -> str:
    """The run to report: the one asked for, or the only one there is; else a clear error."""
    listed = ", ".join(f"{name!r} ({count} steps)" for name, count in runs.most_common()) or "none"
    if run is None:
        if len(runs) == 1:
            return next(iter(runs))
        if not runs:
            raise ReportError(f"{where} holds no steps of any run")
        raise ReportError(f"{where} holds several runs; choose one with --run: {listed}")
    if run not in runs:
        raise ReportError(f"no run {run!r} in {where}; the runs there are: {listed}")
    return run


def load_file(path: Path, run: str | None = None) -> RunModel:
    """The model of ``run`` (or the recording's only run) from a recording file."""
    try:
        with open(path, encoding="utf-8", errors="replace") as lines:
            recording = load_recording(lines)
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from exc
    name = choose_run(runs_in(recording), run, str(path))
    return from_recording(recording, name, f"recording {path.name}")


def _span(steps: list[StepRecord]) -> tuple[float, float]:
    ends = [s.t_end for s in steps if s.t_end is not None]
    if not ends:
        raise ReportError("the run's steps carry no times (t_start): nothing to draw over time")
    starts = [s.t_start for s in steps if s.t_start is not None]
    return min(starts), max(ends)


def from_recording(recording: Recording, run: str, source: str) -> RunModel:
    """Bin the run's steps, their replayed verdicts and the recorded GPU samples."""
    steps = [s for s in recording.steps if s.run == run and s.t_start is not None]
    start, end = _span(steps)
    durations = sorted(s.duration_s for s in steps)
    typical = statistics.median(durations)
    # A bin holds a few of the longer steps of every rank: none is left empty between two.
    slow = durations[int(0.9 * (len(durations) - 1))]
    model = RunModel(run=run, source=source, start=start, end=end,
                     bins=bin_count(start, end, BIN_STEPS * slow))
    model.skipped = Counter(recording.skipped)
    if recording.skipped:
        model.notes.append(f"{sum(recording.skipped.values())} unreadable lines were skipped "
                           f"({', '.join(f'{k}: {v}' for k, v in recording.skipped.most_common())}"
                           f", first at lines "
                           f"{', '.join(str(n) for n, _ in recording.skipped_at[:SKIPPED_SHOWN])})"
                           f"; the report covers the rest")
    model.ranks = sorted({s.rank for s in steps})
    _steps(model, steps, typical)
    subset = Recording(samples=recording.samples, statics=recording.statics, steps=steps)
    _verdicts(model, steps, classify_recording(subset))
    _gpus(model, recording, steps)
    return model


def _steps(model: RunModel, steps: list[StepRecord], typical: float) -> None:
    summary = model.summary
    summary.steps, summary.ranks = len(steps), len(model.ranks)
    summary.seconds = model.end - model.start
    samples = sum(s.samples or 0 for s in steps)
    tokens = sum(s.tokens or 0 for s in steps)
    summary.samples_per_s = samples / summary.seconds if samples and summary.seconds else None
    summary.tokens_per_s = tokens / summary.seconds if tokens and summary.seconds else None
    by_rank: dict[int, list[StepRecord]] = defaultdict(list)
    for step in steps:
        by_rank[step.rank].append(step)
    exposed, overlapped = Mean(model.bins), Mean(model.bins)
    for rank, own in by_rank.items():
        own.sort(key=lambda s: s.t_start or 0.0)
        times = model.mean(model.step_time, rank)
        peaks = model.memory_peak.setdefault(rank, Peak(model.bins))
        ooms: list[int] = []
        previous_end: float | None = None
        for step in own:
            i = model.index(step.t_end or 0.0)
            times.add(i, step.duration_s)
            phases = attributed_phases(step)
            for name in PHASES[:-1]:
                model.mean(model.phases, name).add(i, phases.get(name, 0.0))
            known = sum(v for k, v in phases.items() if k != "other")
            model.mean(model.phases, "other").add(i, max(0.0, step.duration_s - known))
            exposed.add(i, wait_s(step))
            overlapped.add(i, overlapped_s(step))
            if step.comm is not None:
                for op in step.comm.ops:
                    factor = bus_bandwidth_factor(op.name, step.world)
                    if factor and op.seconds > 0:
                        model.mean(model.bus_bandwidth, op.name).add(
                            i, op.bytes / op.seconds * factor)
            if step.mem is not None:
                peaks.add(i, step.mem.peak_bytes or step.mem.reserved_bytes)
                if step.mem.ooms is not None:
                    ooms.append(step.mem.ooms)
            if previous_end is not None and step.t_start is not None:
                gap = step.t_start - previous_end
                if gap > max(STALL_MIN_S, STALL_STEPS * typical):
                    summary.stalls[rank] = max(gap, summary.stalls.get(rank, 0.0))
            previous_end = step.t_end
        if ooms:
            summary.oom_events += max(ooms) - min(ooms) + (1 if min(ooms) > 0 else 0)
    if any(exposed.counts):
        model.comm_exposed, model.comm_overlapped = exposed, overlapped
    _memory(model, by_rank)


def _memory(model: RunModel, by_rank: dict[int, list[StepRecord]]) -> None:
    """The breakdown of the rank with the highest peak, and each rank's time to capacity."""
    highest = {rank: max((p for p in peak.peaks if p is not None), default=0.0)
               for rank, peak in model.memory_peak.items()}
    if not highest or not max(highest.values()):
        model.memory_peak.clear()
        return
    model.memory_rank = max(highest, key=lambda r: highest[r])
    for step in by_rank[model.memory_rank]:
        if step.memory_breakdown is not None:
            i = model.index(step.t_end or 0.0)
            for name in MEMORY_COMPONENTS:
                model.mean(model.memory_components, name).add(
                    i, getattr(step.memory_breakdown, name))


def _oom_predictions(model: RunModel, by_rank: dict[int, list[StepRecord]]) -> None:
    capacity = model.capacity_bytes
    if capacity is None:
        return
    for rank, own in by_rank.items():
        points = [(s.t_end or 0.0, float(s.mem.peak_bytes)) for s in own[-TREND_STEPS:]
                  if s.mem is not None and s.mem.peak_bytes is not None]
        line = theil_sen(points)
        if line is None or line[0] <= 0:
            continue
        slope, _ = line
        left = (capacity - points[-1][1]) / slope
        model.summary.oom_prediction[rank] = (
            f"peak grows {slope / 2**20:.1f} MiB/s; reaches the device's "
            f"{capacity / 2**30:.0f} GiB in {max(left, 0.0) / 60:.1f} min at the run's end")


def _verdicts(model: RunModel, steps: list[StepRecord], verdicts: list) -> None:  # type: ignore[type-arg]
    ends = {(s.rank, s.step): s.t_end or 0.0 for s in steps}
    walls: Counter[str] = Counter()
    hints: dict[str, Counter[str]] = defaultdict(Counter)
    causes: dict[int, Counter[str]] = defaultdict(Counter)
    mfu = Mean(1)
    for v in verdicts:
        primary = v.verdict.primary.value
        strip = model.rank_verdicts(v.rank)
        for number in v.steps:
            strip[model.index(ends.get((v.rank, number), model.end))][primary] += 1
        walls[primary] += len(v.steps)
        hints[primary][v.verdict.hint] += len(v.steps)
        mfu.add(0, v.verdict.mfu)
        if Flag.STRAGGLER in v.verdict.flags:
            cause = v.verdict.straggler_cause
            causes[v.rank][cause.value if cause is not None else "unknown"] += len(v.steps)
    total = sum(walls.values())
    model.summary.walls = {k: n / total for k, n in walls.most_common()} if total else {}
    if walls:
        top = walls.most_common(1)[0][0]
        model.summary.top_hint = hints[top].most_common(1)[0][0]
    model.summary.mfu = mfu.values()[0]
    model.summary.stragglers = {rank: c.most_common(1)[0][0] for rank, c in sorted(causes.items())}


def _gpus(model: RunModel, recording: Recording, steps: list[StepRecord]) -> None:
    """The GPUs the run's ranks named (all the recording's where none can be told)."""
    named = {s.gpu for s in steps if s.gpu is not None}
    by_uuid = {static.uuid: index for index, static in recording.statics.items()}
    indices = {i for i in (by_uuid.get(g) if isinstance(g, str) else g for g in named)
               if i is not None and i in recording.samples}
    chosen = sorted(indices or recording.samples)
    capacities = [total for i in chosen if i in recording.statics
                  for total in [recording.statics[i].memory_total_bytes] if total]
    model.capacity_bytes = float(min(capacities)) if capacities else None
    keys = [k for k, _ in GPU_METRICS] + [k for k, _ in LINK_METRICS]
    for index in chosen:
        for sample in recording.samples[index]:
            if not model.start <= sample.t <= model.end:
                continue
            i = model.index(sample.t)
            for key in keys:
                value = getattr(sample, _FIELDS.get(key, key), None)
                if value is not None:
                    model.mean(model.gpu[key], index).add(i, value)
    by_rank: dict[int, list[StepRecord]] = defaultdict(list)
    for step in steps:
        by_rank[step.rank].append(step)
    for own in by_rank.values():
        own.sort(key=lambda s: s.t_start or 0.0)
    _oom_predictions(model, by_rank)


_FIELDS = {"utilization": "utilization_ratio", "sm_active": "sm_active_ratio",
           "tensor_active": "tensor_active_ratio", "dram_active": "dram_active_ratio"}
