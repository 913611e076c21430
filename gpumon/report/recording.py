"""A run from a recording: its steps replayed through the verdict engine ``gpumon classify``
uses (``replay.py``), put into time bins as they come with the GPU samples recorded beside
them, each rank's layout from its recorded hello, and where each rank's time went from its
latest ``time`` line. Memory does not grow with the recording's length."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from math import isfinite
from pathlib import Path

from gpumon.analysis.bottleneck import Flag
from gpumon.analysis.comm import bus_bandwidth_factor, phases_less_wait, wait_s
from gpumon.analysis.stream import RankAnalysis, StepVerdict
from gpumon.collectors.samples import GpuSample
from gpumon.report.model import (
    GPU_METRICS,
    LINK_METRICS,
    MEMORY_COMPONENTS,
    PHASES,
    Mean,
    ReportError,
    RunModel,
    bin_count,
)
from gpumon.report.replay import Scan, quick_scan, replay, scan
from gpumon.wire import StepRecord

STALL_STEPS = 10
"""A gap between a rank's steps longer than this many typical steps (and ``STALL_MIN_S``) is
a stall, as the straggler rule leaves out a rank that far behind (docs/architecture.md §7)."""
STALL_MIN_S = 5.0
BIN_STEPS = 3
"""Steps (of the slowest tenth) a time bin spans at the finest."""
WINDOWS_PER_BIN = 4
"""The engine's windows per time bin at the coarsest (replay.py: a long run's resolution)."""
_FIELDS = {"utilization": "utilization_ratio", "sm_active": "sm_active_ratio",
           "tensor_active": "tensor_active_ratio", "dram_active": "dram_active_ratio"}
_SAMPLE_KEYS = tuple((key, _FIELDS.get(key, key)) for key, _ in (*GPU_METRICS, *LINK_METRICS))
"""(figure key, ``GpuSample`` attribute) of what a GPU sample adds to the page."""


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


@contextmanager
def _lines(path: Path) -> Iterator[Iterator[str]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as lines:
            yield lines
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from exc


def load_file(path: Path, run: str | None = None) -> RunModel:
    """The model of ``run`` (or the recording's only run) from a recording file.

    The first pass is guessed from the text (``quick_scan``) and the replay makes the checked
    scan as it reads; where the two differ (a line the guess took that the records' checks
    refuse, a line not in the agent's form read otherwise), the file is replayed again from the
    checked scan, so the page is always the one a checked first pass gives."""
    with _lines(path) as lines:
        quick = quick_scan(lines)
    try:
        model, check = _load(path, run, quick)
    except ReportError:
        with _lines(path) as lines:
            check = scan(lines)  # the error, or none, as the checked scan has it
    else:
        if check == quick:
            return model
    return _load(path, run, check)[0]


def _load(path: Path, run: str | None, found: Scan) -> tuple[RunModel, Scan]:
    """The model from a first pass's ``found``, and the replay's own count of skipped lines."""
    if not found.runs and found.skipped:
        raise ReportError(f"{path} holds no readable step: {_skipped_text(found)}")
    name = choose_run(found.runs, run, str(path))
    durations = sorted(found.durations[name])
    slow = durations[int(0.9 * (len(durations) - 1))]
    start, end = found.start[name], found.end[name]
    model = RunModel(run=name, source=f"recording {path.name}", start=start, end=end,
                     bins=bin_count(start, end, BIN_STEPS * slow))
    _skipped(model, found)
    model.time_totals = {rank: totals for (run_name, rank), (_, totals)
                         in sorted(found.times.items()) if run_name == name}
    filler = _Filler(model, found, typical=statistics.median(durations))
    check = Scan()
    with _lines(path) as lines:
        analyses = replay(lines, name, found, filler.step, filler.sample, filler.verdict,
                          min_window_s=model.width_s / WINDOWS_PER_BIN, check=check)
    filler.finish(analyses)
    return model, check


def _skipped(model: RunModel, found: Scan) -> None:
    if found.skipped:
        model.notes.append(f"{_skipped_text(found)}; the report covers the rest")


def _skipped_text(found: Scan) -> str:
    reasons = ", ".join(f"{k}: {v}" for k, v in found.skipped.most_common())
    lines = ", ".join(str(n) for n in found.skipped_at)
    return (f"{sum(found.skipped.values())} unreadable lines were skipped ({reasons}, "
            f"first at lines {lines})")


class _Filler:
    """Puts each step, sample and verdict into the model's bins as the replay yields it."""

    def __init__(self, model: RunModel, found: Scan, typical: float) -> None:
        self.model = model
        self.typical = typical
        self.statics = found.statics
        self.layouts = {rank: layout for (run, rank), layout in found.layouts.items()
                        if run == model.run}
        self.samples = self.tokens = 0
        self.gpus: set[int | str] = set()
        self.previous_end: dict[int, float] = {}
        self.ooms: dict[int, tuple[int, int]] = {}
        self.components: dict[int, dict[str, Mean]] = defaultdict(dict)
        self.gpu_samples: dict[int, dict[str, Mean]] = defaultdict(dict)
        self.walls: Counter[str] = Counter()
        self.hints: dict[str, Counter[str]] = defaultdict(Counter)
        self.causes: dict[int, Counter[str]] = defaultdict(Counter)
        self.mfu = Mean(1)
        self.step_times: dict[int, Mean] = {}
        """Rank → its ``model.step_time`` mean, looked up once."""
        self.steps: Counter[int] = Counter()
        self.own_s: dict[int, float] = defaultdict(float)
        self.bubble_s: dict[int, float] = defaultdict(float)
        self.received_s: dict[int, float] = defaultdict(float)  # of steps carrying a bubble
        model.comm_exposed, model.comm_overlapped = Mean(model.bins), Mean(model.bins)
        self.phase_means: list[Mean] = []
        self.last_bin = model.bins - 1
        self.factors: dict[tuple[str, int | None], float | None] = {}
        """(collective, world) → its bus-bandwidth factor, looked up once."""

    def step(self, step: StepRecord) -> None:
        """A step into the bins: ten means, a peak, and the rank's own work. A day of 64 ranks
        is a million steps: ``Mean.add`` and the tables' lookups are inline here."""
        model, summary = self.model, self.model.summary
        duration, t_start = step.duration_s, step.t_start
        end = (None if t_start is None else t_start + duration) or model.end  # step.t_end
        i = int((end - model.start) / model.width_s)  # model.index(end)
        i = 0 if i < 0 else min(i, self.last_bin)
        summary.steps += 1
        self.samples += step.samples or 0
        self.tokens += step.tokens or 0
        if step.gpu is not None:
            self.gpus.add(step.gpu)
        step_time = self.step_times.get(step.rank)
        if step_time is None:
            step_time = self.step_times[step.rank] = model.mean(model.step_time, step.rank)
        if isfinite(duration):
            step_time.sums[i] += duration
            step_time.counts[i] += 1
        wait = wait_s(step)
        self._parallel(step, i, max(0.0, duration - (wait or 0.0)))  # own_work_s
        phases = phases_less_wait(step, wait)  # attributed_phases(step)
        if not self.phase_means:  # made on the first step, in the order of PHASES
            self.phase_means = [model.mean(model.phases, name) for name in PHASES]
        for name, mean in zip(PHASES[:-1], self.phase_means, strict=False):
            value = phases.get(name, 0.0)
            if isfinite(value):
                mean.sums[i] += value
                mean.counts[i] += 1
        # sum(v for k, v in phases.items() if k != "other"), the same sum in the same order
        known = sum(v for k, v in phases.items() if k != "other") if "other" in phases \
            else sum(phases.values())
        other = max(0.0, duration - known)
        if isfinite(other):
            self.phase_means[-1].sums[i] += other
            self.phase_means[-1].counts[i] += 1
        exposed, overlapped = model.comm_exposed, model.comm_overlapped
        assert exposed is not None and overlapped is not None
        if wait is not None and isfinite(wait):
            exposed.sums[i] += wait
            exposed.counts[i] += 1
        comm = step.comm
        if comm is not None:
            overlap = max(0.0, comm.busy_s - comm.exposed_s)  # overlapped_s(step)
            if isfinite(overlap):
                overlapped.sums[i] += overlap
                overlapped.counts[i] += 1
            for op in comm.ops:
                key = (op.name, step.world)
                if key not in self.factors:
                    self.factors[key] = bus_bandwidth_factor(op.name, step.world)
                factor = self.factors[key]
                if factor and op.seconds > 0:
                    model.mean(model.bus_bandwidth, op.name).add(i, op.bytes / op.seconds * factor)
                if op.name == "all_to_all":
                    model.mean(model.all_to_all, step.rank).add(i, op.seconds)
        if step.moe is not None:
            for load in step.moe.layers:
                model.peak(model.moe_ratio, load.layer).add(i, load.max_ratio)
        if step.mem is not None:
            model.peak(model.memory_peak, step.rank).add(
                i, step.mem.peak_bytes or step.mem.reserved_bytes)  # made once, not a step
            if step.mem.ooms is not None:
                low, high = self.ooms.get(step.rank, (step.mem.ooms, step.mem.ooms))
                self.ooms[step.rank] = (min(low, step.mem.ooms), max(high, step.mem.ooms))
        if step.memory_breakdown is not None:
            for name in MEMORY_COMPONENTS:
                model.mean(self.components[step.rank], name).add(
                    i, getattr(step.memory_breakdown, name))
        previous = self.previous_end.get(step.rank)
        if previous is not None and t_start is not None:
            gap = t_start - previous
            if gap > max(STALL_MIN_S, STALL_STEPS * self.typical):
                summary.stalls[step.rank] = max(gap, summary.stalls.get(step.rank, 0.0))
        self.previous_end[step.rank] = max(end, previous or end)

    def _parallel(self, step: StepRecord, i: int, own_s: float) -> None:
        """Own work per step (``own_s``: ``straggler.own_work_s``), and the bubble of a step
        that received from another rank."""
        self.steps[step.rank] += 1
        self.own_s[step.rank] += own_s
        if step.comm is not None and step.comm.bubble_s is not None:
            self.bubble_s[step.rank] += step.comm.bubble_s
            self.received_s[step.rank] += step.duration_s
            if step.duration_s > 0:
                self.model.mean(self.model.bubble, step.rank).add(
                    i, step.comm.bubble_s / step.duration_s)

    def sample(self, sample: GpuSample) -> None:
        if not self.model.start <= sample.t <= self.model.end:
            return
        i = self.model.index(sample.t)
        held = self.gpu_samples[sample.index]
        for key, attribute in _SAMPLE_KEYS:  # a day of 8 GPUs at 1 s: 691,200 samples
            value = getattr(sample, attribute, None)
            if value is not None:
                mean = held.get(key)
                if mean is None:
                    mean = held[key] = Mean(self.model.bins)
                if math.isfinite(value):  # Mean.add, inline: eight a sample
                    mean.sums[i] += value
                    mean.counts[i] += 1

    def verdict(self, v: StepVerdict, end: float) -> None:
        primary = v.verdict.primary.value
        self.model.rank_verdicts(v.rank)[self.model.index(end)][primary] += len(v.steps)
        self.walls[primary] += len(v.steps)
        self.hints[primary][v.verdict.hint] += len(v.steps)
        self.mfu.add(0, v.verdict.mfu)
        if Flag.STRAGGLER in v.verdict.flags:
            cause = v.verdict.straggler_cause
            self.causes[v.rank][cause.value if cause is not None else "unknown"] += len(v.steps)

    def finish(self, analyses: list[RankAnalysis]) -> None:
        model, summary = self.model, self.model.summary
        model.ranks = sorted(model.step_time)
        summary.ranks = len(model.ranks)
        summary.seconds = model.end - model.start
        if summary.seconds > 0:
            summary.samples_per_s = self.samples / summary.seconds if self.samples else None
            summary.tokens_per_s = self.tokens / summary.seconds if self.tokens else None
        summary.oom_events = sum(high - low + (low > 0) for low, high in self.ooms.values())
        assert model.comm_exposed is not None
        if not any(model.comm_exposed.counts):
            model.comm_exposed = model.comm_overlapped = None
        total = sum(self.walls.values())
        if total:
            summary.walls = {k: n / total for k, n in self.walls.most_common()}
            summary.top_hint = self.hints[self.walls.most_common(1)[0][0]].most_common(1)[0][0]
        summary.mfu = self.mfu.values()[0]
        summary.stragglers = {r: c.most_common(1)[0][0] for r, c in sorted(self.causes.items())}
        model.layouts = {r: self.layouts[r] for r in model.ranks if r in self.layouts}
        model.own_work_s = {r: self.own_s[r] / n for r, n in sorted(self.steps.items())}
        model.bubble_share = {r: self.bubble_s[r] / t for r, t in sorted(self.received_s.items())
                              if t > 0}
        self._gpus()
        self._memory(analyses)

    def _gpus(self) -> None:
        """The GPUs the run's ranks named (all the recording's where none can be told)."""
        by_uuid = {static.uuid: index for index, static in self.statics.items()}
        named = {by_uuid.get(g) if isinstance(g, str) else g for g in self.gpus}
        chosen = sorted({i for i in named if i is not None and i in self.gpu_samples}
                        or self.gpu_samples)
        for index in chosen:
            for key, mean in self.gpu_samples[index].items():
                self.model.gpu[key][index] = mean
        capacities = [total for i in chosen if i in self.statics
                      for total in [self.statics[i].memory_total_bytes] if total]
        self.model.capacity_bytes = float(min(capacities)) if capacities else None

    def _memory(self, analyses: list[RankAnalysis]) -> None:
        """The breakdown of the rank with the highest peak, and the engine's OOM prediction."""
        model = self.model
        highest = {rank: max((p for p in peak.peaks if p is not None), default=0.0)
                   for rank, peak in model.memory_peak.items()}
        if not highest or not max(highest.values()):
            model.memory_peak.clear()
            return
        model.memory_rank = max(highest, key=lambda r: highest[r])
        model.memory_components = self.components.get(model.memory_rank, {})
        for analysis in analyses:
            oom = analysis.oom
            if analysis.run != model.run or oom is None or oom.predicted_seconds is None \
                    or not math.isfinite(oom.predicted_seconds):
                continue
            trend = oom.peak_trend_bytes_per_second or 0.0
            model.summary.oom_prediction[analysis.rank] = (
                oom.predicted_seconds, f"peak grows {trend / 2**20:.1f} MiB/s; capacity reached in "
                f"{oom.predicted_seconds / 60:.1f} min after the run's last step "
                f"(risk {oom.risk_ratio:.0%})")
