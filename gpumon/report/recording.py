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
from gpumon.report.binned import Binned, worth_it
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
from gpumon.report.replay import Scan, in_order, quick_scan, replay, scan
from gpumon.wire import CollectiveOp, StepRecord

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
_STACKED = PHASES[:-1]
"""The phases a step reports, below the time no phase covers (``other``)."""


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
    binned = Binned(lambda: fill_bins(path, name, filler), filler) if worth_it() else None
    try:
        with _lines(path) as lines:
            analyses = replay(lines, name, found, None if binned else filler.step,
                              None if binned else filler.sample, filler.verdict,
                              min_window_s=model.width_s / WINDOWS_PER_BIN, check=check)
    except BaseException:
        if binned is not None:
            binned.abandon()
        raise
    if binned is not None:
        binned.take_into(filler)
    filler.finish(analyses)
    return model, check


def fill_bins(path: Path, run: str, filler: _Filler) -> None:
    """The steps and GPU samples into ``filler``'s bins, in the replay's order."""
    with _lines(path) as lines:
        for item in in_order(lines, run):
            if isinstance(item, GpuSample):
                filler.sample(item)
            else:
                filler.step(item[1])


def _skipped(model: RunModel, found: Scan) -> None:
    if found.skipped:
        model.notes.append(f"{_skipped_text(found)}; the report covers the rest")


def _skipped_text(found: Scan) -> str:
    reasons = ", ".join(f"{k}: {v}" for k, v in found.skipped.most_common())
    lines = ", ".join(str(n) for n in found.skipped_at)
    return (f"{sum(found.skipped.values())} unreadable lines were skipped ({reasons}, "
            f"first at lines {lines})")


class _Rank:
    """What the filler keeps of one rank: its tables, its own work and its bubble so far."""

    __slots__ = ("step_time", "peak", "steps", "own_s", "bubble_s", "received_s",
                 "previous_end")

    def __init__(self, step_time: Mean) -> None:
        self.step_time = step_time
        """Its ``model.step_time`` mean, looked up once."""
        self.peak: Peak | None = None
        """Its ``model.memory_peak``, once a step of it carried memory figures."""
        self.steps = 0
        self.own_s = self.bubble_s = 0.0
        self.received_s = 0.0
        """Seconds of its steps that carried a bubble."""
        self.previous_end: float | None = None


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
        self.ooms: dict[int, tuple[int, int]] = {}
        self.components: dict[int, dict[str, Mean]] = defaultdict(dict)
        self.gpu_samples: dict[int, dict[str, Mean]] = defaultdict(dict)
        self.walls: Counter[str] = Counter()
        self.hints: dict[str, Counter[str]] = defaultdict(Counter)
        self.causes: dict[int, Counter[str]] = defaultdict(Counter)
        self.mfu = Mean(1)
        self.ranks: dict[int, _Rank] = {}
        self.stall_s = max(STALL_MIN_S, STALL_STEPS * typical)
        self.exposed = model.comm_exposed = Mean(model.bins)
        self.overlapped = model.comm_overlapped = Mean(model.bins)
        self.phase_means: list[Mean] = []
        self.last_bin = model.bins - 1
        self.factors: dict[tuple[str, int | None], float | None] = {}
        """(collective, world) → its bus-bandwidth factor, looked up once."""

    def step(self, step: StepRecord) -> None:
        """A step into the bins: ten means, a peak, and the rank's own work. A day of 64 ranks
        is a million steps: ``Mean.add``, ``Peak.add`` and the tables' lookups are inline
        here, and what each rank and each collective looks up is kept (``_rank``, ``_op``)."""
        model, summary = self.model, self.model.summary
        duration, t_start, rank = step.duration_s, step.t_start, step.rank
        end = (None if t_start is None else t_start + duration) or model.end  # step.t_end
        i = int((end - model.start) / model.width_s)  # model.index(end)
        i = 0 if i < 0 else (i if i < self.last_bin else self.last_bin)
        summary.steps += 1
        self.samples += step.samples or 0
        self.tokens += step.tokens or 0
        if step.gpu is not None:
            self.gpus.add(step.gpu)
        held = self.ranks.get(rank)
        if held is None:
            held = self.ranks[rank] = _Rank(model.mean(model.step_time, rank))
        if isfinite(duration):
            held.step_time.sums[i] += duration
            held.step_time.counts[i] += 1
        wait = wait_s(step)
        own = duration - (wait or 0.0)
        held.steps += 1
        held.own_s += own if own > 0.0 else 0.0  # max(0.0, own), NaN included: own_work_s
        comm = step.comm
        if comm is not None and comm.bubble_s is not None:
            self._bubble(held, step, i)
        phases = phases_less_wait(step, wait)  # attributed_phases(step)
        means = self.phase_means
        if not means:  # made on the first step, in the order of PHASES
            means = self.phase_means = [model.mean(model.phases, name) for name in PHASES]
        get = phases.get
        for name, mean in zip(_STACKED, means, strict=False):
            # The phases are finite (``phases_less_wait`` keeps only those, and its ``comm``
            # is ``wait_s``, finite): ``Mean.add``'s check cannot refuse one.
            mean.sums[i] += get(name, 0.0)
            mean.counts[i] += 1
        # sum(v for k, v in phases.items() if k != "other"), the same sum in the same order
        known = sum(v for k, v in phases.items() if k != "other") if "other" in phases \
            else sum(phases.values())
        other = duration - known
        other = other if other > 0.0 else 0.0  # max(0.0, other)
        if isfinite(other):
            means[-1].sums[i] += other
            means[-1].counts[i] += 1
        if wait is not None:  # finite (wait_s): Mean.add, inline
            exposed = self.exposed
            exposed.sums[i] += wait
            exposed.counts[i] += 1
        if comm is not None:
            overlap = comm.busy_s - comm.exposed_s
            overlap = overlap if overlap > 0.0 else 0.0  # overlapped_s(step)
            if isfinite(overlap):
                self.overlapped.sums[i] += overlap
                self.overlapped.counts[i] += 1
            for op in comm.ops:
                self._op(op, step, i)
        if step.moe is not None:
            for load in step.moe.layers:
                model.peak(model.moe_ratio, load.layer).add(i, load.max_ratio)
        mem = step.mem
        if mem is not None:
            peak = held.peak
            if peak is None:
                peak = held.peak = model.peak(model.memory_peak, rank)
            peak.add(i, mem.peak_bytes or mem.reserved_bytes)
            if mem.ooms is not None:
                low, high = self.ooms.get(rank, (mem.ooms, mem.ooms))
                self.ooms[rank] = (min(low, mem.ooms), max(high, mem.ooms))
        if step.memory_breakdown is not None:
            for name in MEMORY_COMPONENTS:
                model.mean(self.components[rank], name).add(
                    i, getattr(step.memory_breakdown, name))
        previous = held.previous_end
        if previous is not None and t_start is not None:
            gap = t_start - previous
            if gap > self.stall_s:
                summary.stalls[rank] = max(gap, summary.stalls.get(rank, 0.0))
        held.previous_end = max(end, previous or end)

    def _bubble(self, held: _Rank, step: StepRecord, i: int) -> None:
        """The bubble of a step that received from another rank."""
        assert step.comm is not None and step.comm.bubble_s is not None
        held.bubble_s += step.comm.bubble_s
        held.received_s += step.duration_s
        if step.duration_s > 0:
            self.model.mean(self.model.bubble, step.rank).add(
                i, step.comm.bubble_s / step.duration_s)

    def _op(self, op: CollectiveOp, step: StepRecord, i: int) -> None:
        """A collective's bus bandwidth, and the seconds of an all-to-all."""
        key = (op.name, step.world)
        factor = self.factors.get(key, 0.0)
        if factor == 0.0 and key not in self.factors:
            factor = self.factors[key] = bus_bandwidth_factor(op.name, step.world)
        if factor and op.seconds > 0:
            bandwidth = self.model.bus_bandwidth.get(op.name)
            if bandwidth is None:
                bandwidth = self.model.mean(self.model.bus_bandwidth, op.name)
            value = op.bytes / op.seconds * factor
            if isfinite(value):  # Mean.add, inline
                bandwidth.sums[i] += value
                bandwidth.counts[i] += 1
        if op.name == "all_to_all":
            self.model.mean(self.model.all_to_all, step.rank).add(i, op.seconds)

    def sample(self, sample: GpuSample) -> None:
        model, t = self.model, sample.t
        if not model.start <= t <= model.end:
            return
        i = int((t - model.start) / model.width_s)  # model.index(t): t is in the run
        i = 0 if i < 0 else (i if i < self.last_bin else self.last_bin)
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
        ranks = sorted(self.ranks.items())
        model.own_work_s = {r: held.own_s / held.steps for r, held in ranks}
        model.bubble_share = {r: held.bubble_s / held.received_s for r, held in ranks
                              if held.received_s > 0}
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
