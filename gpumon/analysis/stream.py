"""Streaming verdicts: steps and GPU samples in, per-rank verdicts and OOM risk out.

The same engine serves the live agent and ``gpumon classify`` replaying a recording. It
works on per-rank state (``tracker.RankTracker``: steps waiting for their GPU samples, recent
own-work times for the straggler comparison, recent peaks for the OOM trend) kept where its
``Trackers`` say: in the agent, on the rank store's record of each rank, so that a rank expires, is evicted
or is forgotten in one place; in a replay, a table of its own. It does no I/O and reads no
clock: the caller passes "now" and a function returning a GPU's samples over a window.

A step is analysed once the GPU samples covering its window can have arrived (``lag_s``
after it ended). Steps shorter than the sampler's resolution are merged with the following
ones until the window spans it, and the verdict counts for every step merged.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from types import MappingProxyType

from gpumon.analysis.bottleneck import (
    Bottleneck,
    DeviceSpec,
    Flag,
    StepEvidence,
    Verdict,
    classify,
)
from gpumon.analysis.device_timing import device_shares
from gpumon.analysis.devices import resolve_peak_dram, resolve_peak_flops, resolve_peak_nvlink
from gpumon.analysis.memory import MemoryAttribution, attribute_growth
from gpumon.analysis.oom import OomRisk, assess_oom_risk
from gpumon.analysis.straggler import (
    RankWork,
    Standing,
    judge_run,
)
from gpumon.analysis.thresholds import DEFAULT, Thresholds
from gpumon.analysis.tracker import (
    Analysed,
    RankAnalysis,
    RankKey,
    RankTracker,
    Received,
    Trackers,
    TrackerTable,
    new_tracker,
    new_version,
    renewed,
)
from gpumon.analysis.window import group_steps, merge_steps, span_s, summarize_gpu_window
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.wire import ParallelLayout, StepRecord

History = Callable[[int, float, float], Sequence[GpuSample]]
"""(gpu index, t0, t1) -> that GPU's samples with t0 <= t <= t1."""

SILENT_STEPS = 10  # a rank this many of its run's typical steps behind the newest is silent
SILENT_MIN_S = 5.0  # ... and at least this many seconds behind
MAX_PENDING = 4096  # steps waiting per rank; beyond, the oldest are dropped
CLOCK_SKEW_TOLERANCE_S = 5.0  # a step "ending" later than this after receipt is re-based
VERDICT_WORK = 32  # a verdict costs about what grouping and merging this many steps does
SLICE_WORK = 256  # under a millisecond of a pass: a few verdicts of ten steps each
# (both measured by benchmarks/bench_internals.py; figures in benchmarks/RESULTS.md)


@dataclass(frozen=True)
class StepVerdict:
    """A verdict and the steps (of one rank) it was reached for."""

    run: str
    rank: int
    steps: tuple[int, ...]
    verdict: Verdict


def attribute_gpu(gpu: str | int | None, pid: int | None, statics: Sequence[GpuStatic],
                  latest: Mapping[int, GpuSample]) -> int | None:
    """The local GPU index a rank runs on: its reported UUID, else NVML's process list by pid,
    else its reported CUDA index (which CUDA_VISIBLE_DEVICES may have renumbered)."""
    if isinstance(gpu, str):
        for static in statics:
            if static.uuid == gpu:
                return static.index
    if pid is not None:
        for index, sample in latest.items():
            if sample.process_memory_bytes and pid in sample.process_memory_bytes:
                return index
    if isinstance(gpu, int) and any(s.index == gpu for s in statics):
        return gpu
    if isinstance(gpu, str) and gpu.isdigit() and any(s.index == int(gpu) for s in statics):
        return int(gpu)
    return None


class StepAnalyzer:
    """Not thread-safe: a caller feeding it from several threads holds one lock around it
    (``ranks``, the rank store in the agent, has its own for which ranks there are).

    ``ranks`` holds the per-rank state; by default a table of the analyzer's own.

    ``oom_when_read``: a rank's OOM risk is assessed when ``analyses`` is called, from what
    its latest window that could assess it left, rather than after every window (the same
    risk; a replay that reads it once at its end, as the report does, skips the Theil–Sen
    slopes of every other window). Until then the ``oom`` of ``RankTracker.analysis`` is an
    earlier window's."""

    def __init__(self, resolution_s: float, thresholds: Thresholds = DEFAULT,
                 peak_flops_override: float | None = None,
                 ranks: Trackers | None = None, oom_when_read: bool = False) -> None:
        self.resolution_s = resolution_s
        self.lag_s = resolution_s + 0.5
        self.thresholds = thresholds
        self._peak_override = peak_flops_override
        self._ranks: Trackers = ranks if ranks is not None else TrackerTable()
        self._oom_when_read = oom_when_read
        self._oom_unread: dict[int, tuple[RankTracker, Callable[[], OomRisk],
                                          MemoryAttribution | None]] = {}
        """id(tracker) → the tracker, its latest assessment not yet made, what fills it."""

    def add(self, steps: Iterable[StepRecord], received_t: float,
            pids: Mapping[RankKey, int | None] | None = None) -> None:
        """Queue steps; a step without ``t_start``, or one claiming to end well after it
        was received (a client clock running ahead), is taken to have ended when received.
        Steps of a rank ``ranks`` no longer holds are dropped."""
        full: list[Received] = []
        key: RankKey | None = None
        state: RankTracker | None = None
        for step in steps:
            end = step.t_end
            if end is None or end > received_t + CLOCK_SKEW_TOLERANCE_S:
                step = replace(step, t_start=received_t - step.duration_s)
                end = step.t_end
            if (step.run, step.rank) != key:  # a batch is mostly one rank's: one look-up
                key = (step.run, step.rank)
                state = self._ranks.tracker(key)
            if state is None:
                continue
            received = state.received
            if step.world is not None and step.world != received.world:
                if received.world is not None:
                    # A restarted (elastic) job: what this rank did before describes another run.
                    state.conclude(world_changes=state.analysis.world_changes + 1)
                    received.restart()
                received.world = step.world
            received.last_end_t = max(received.last_end_t, end or received_t)
            # The comparison reads only the records, so it keeps up with them rather than
            # with the analysis, which waits for the GPU samples.
            received.take(step)
            if step.memory_breakdown is not None:
                received.breakdowns.append((step.t_end or received_t, step.memory_breakdown))
            if pids and pids.get(key) is not None:
                received.last_pid = pids[key]
            if len(received.pending) == MAX_PENDING + 1:
                full.append(received)
        # Trimmed once per call rather than per step (a flood would move 4,096 steps for
        # each one added); nothing reads them in between.
        for received in full:
            del received.pending[: len(received.pending) - MAX_PENDING]

    def process(self, now_t: float, history: History, statics: Sequence[GpuStatic],
                latest: Mapping[int, GpuSample],
                layouts: Mapping[RankKey, ParallelLayout] | None = None) -> list[StepVerdict]:
        """Analyse every step whose window is complete; returns the verdicts reached."""
        return next(self.process_in_slices(now_t, history, statics, latest, math.inf,
                                           layouts=layouts), [])

    def has_ranks(self) -> bool:
        """Whether any rank is held (has steps, analysed or not)."""
        return bool(self._ranks.trackers())

    def process_in_slices(self, now_t: float, history: History, statics: Sequence[GpuStatic],
                          latest: Mapping[int, GpuSample],
                          slice_work: float = SLICE_WORK,
                          xid_gpus: Collection[int] = (),
                          layouts: Mapping[RankKey, ParallelLayout] | None = None,
                          ) -> Iterator[list[StepVerdict]]:
        """``process`` a little at a time: yields the verdicts of each slice of about
        ``slice_work`` units (a step grouped is one, a verdict ``VERDICT_WORK``).

        ``xid_gpus`` are the local GPUs that have reported XID errors: a straggler on one of
        them has its GPU as the cause. ``layouts`` are the ranks' places in their jobs'
        parallelism, where known: a rank is compared with its data-parallel replicas.

        Between slices the caller may release its lock, so that ``add`` and ``analyses`` wait
        for one slice rather than for the whole pass. The verdicts are those of an unsliced
        pass: a rank's analysis depends only on its own steps, and the one comparison across
        ranks, the straggler comparison (each rank's median own work against its peers'), is
        made once, before the first slice, from every step received so far — it needs no
        GPU samples, so the verdicts of this pass already use it. Steps added between slices
        are analysed in this pass if their rank's turn has not come (as if added just before
        the pass), otherwise in the next (just after); a rank first seen between slices waits
        for the next pass. A reader between slices sees some ranks' new verdicts beside
        others' old ones, all with this pass's comparison.
        """
        by_index = {s.index: s for s in statics}
        layouts = layouts or {}
        thresholds = self.thresholds  # one pass, one set, even if reloaded between slices
        self._compare_ranks(thresholds, layouts)
        cutoff = now_t - self.lag_s
        done: list[StepVerdict] = []
        work = 0
        for state in self._ranks.trackers():
            pending = state.received.pending
            # A rank's steps arrive in order: the ready ones are a prefix.
            k = 0
            for step in pending:
                end = step.t_end
                if end is None or end > cutoff:
                    break
                k += 1
            if k == 0:
                continue
            groups = group_steps(pending[:k], self.resolution_s)
            last = groups[-1]
            # Hold back a recent last group shorter than the resolution: its next step may
            # still come, or be waiting. An old one (the job stopped) is analysed as it is.
            if span_s(last) < self.resolution_s \
                    and (last[-1].t_end or 0.0) > cutoff - 5 * self.resolution_s:
                groups.pop()
                k -= len(last)
            # Taken off before the first yield: steps added meanwhile land after these.
            del pending[:k]
            work += k
            for members in groups:
                analysed = state.analysed
                analysed.device_shares = device_shares(members) or analysed.device_shares
                merged = merge_steps(members, analysed.device_shares)
                verdict, state.analysis = self._analyse(
                    state, merged, len(members), members[-1], history, by_index, latest,
                    thresholds, xid_gpus)
                done.append(StepVerdict(merged.run, merged.rank,
                                        tuple(m.step for m in members), verdict))
                work += VERDICT_WORK
                if work >= slice_work:
                    yield done
                    done, work = [], 0
        if done:
            yield done

    def _analyse(self, state: RankTracker, group: StepRecord, steps: int, last: StepRecord,
                 history: History, statics: Mapping[int, GpuStatic],
                 latest: Mapping[int, GpuSample], thresholds: Thresholds,
                 xid_gpus: Collection[int]) -> tuple[Verdict, RankAnalysis]:
        """The verdict on ``group`` (``steps`` steps merged, ``last`` the newest) and the
        rank's analysis after it: reads what the rank received, its window history (which it
        extends) and its standing among its peers; returns what the rank is now said to be."""
        analysis, analysed = state.analysis, state.analysed
        index = attribute_gpu(last.gpu, last.pid or state.received.last_pid,
                              list(statics.values()), latest)
        static = statics.get(index) if index is not None else None
        window = None
        if index is not None and group.t_start is not None and group.t_end is not None:
            window = summarize_gpu_window(history(index, group.t_start, group.t_end),
                                          group.t_start, group.t_end)
        name = static.name if static else None
        previous = analysed.last
        memory = attribute_growth(list(state.received.breakdowns))
        verdict = classify(StepEvidence(
            group, window,
            device=DeviceSpec(
                peak_flops=resolve_peak_flops(name, self._peak_override),
                memory_total_bytes=static.memory_total_bytes if static else None,
                peak_dram_bytes_per_second=resolve_peak_dram(name),
                peak_nvlink_bytes_per_second=resolve_peak_nvlink(name)),
            standing=analysis.standing,
            previous_mem=previous.mem if previous else None,
            memory_remedy=memory.text if memory is not None else None,
            recent_comm=tuple(analysed.comm_shares),
        ), thresholds)
        if verdict.fractions["other"] < 1.0:  # its shares were measured (phases or comm)
            analysed.comm_shares.append(verdict.fractions["comm"])
        bottleneck_steps = Counter(analysis.bottleneck_steps)
        bottleneck_steps[verdict.primary.value] += steps
        analysed.durations.append(group.duration_s / steps)
        if last.mem is not None and last.mem.peak_bytes is not None and last.t_end is not None:
            analysed.peaks.append((last.t_end, last.mem.peak_bytes))
        capacity = static.memory_total_bytes if static else None
        period = statistics.median(analysed.durations)
        oom = analysis.oom
        if capacity and (analysed.peaks or last.mem is not None):
            sample = latest.get(index) if index is not None else None
            mem = last.mem
            assess = partial(
                assess_oom_risk,
                list(analysed.peaks),
                capacity_bytes=capacity,
                nvml_used_bytes=sample.memory_used_bytes if sample else None,
                reserved_bytes=mem.reserved_bytes if mem else None,
                allocated_bytes=mem.allocated_bytes if mem else None,
                alloc_retries_delta=_delta(previous, last, "alloc_retries"),
                ooms_delta=_delta(previous, last, "ooms"),
                step_period_s=period,
            )
            if self._oom_when_read:
                self._oom_unread[id(state)] = (state, assess, memory)
            else:
                oom = _oom(assess, memory)
        analysed.last = last
        return verdict, renewed(
            analysis, gpu=index, memory=memory, verdict=verdict, verdict_step=last.step,
            bottleneck_steps=MappingProxyType(dict(bottleneck_steps)), oom=oom,
            step_period_s=period,
            sm_clock_hz=window.sm_clock_hz if window is not None else None,
            gpu_trouble=Flag.THROTTLED in verdict.flags or index in xid_gpus,
            version=new_version())

    def _compare_ranks(self, thresholds: Thresholds,
                       layouts: Mapping[RankKey, ParallelLayout]) -> None:
        """Each run's straggler comparison (``straggler.judge_run``), over the ranks that are
        still reporting at the run's current world size, each compared with the ranks that do
        the same work: its data-parallel replicas where its layout is known (``layouts``),
        else every rank of its run whose layout is not known either."""
        runs: dict[str, list[RankTracker]] = {}
        for state in self._ranks.trackers():
            runs.setdefault(state.analysis.run, []).append(state)
        for states in runs.values():
            newest = max(states, key=lambda s: s.received.last_end_t).received
            periods = [s.analysis.step_period_s for s in states
                       if s.analysis.step_period_s is not None]
            behind_s = max(SILENT_MIN_S, SILENT_STEPS * statistics.median(periods)
                           if periods else 0.0)
            groups: dict[object, tuple[dict[int, RankWork], set[int]]] = {}
            own: dict[int, float] = {}
            for state in states:
                rank, received = state.analysis.rank, state.received
                if newest.world is not None and (received.world != newest.world
                                                 or rank >= newest.world):
                    continue  # a rank of an earlier world size
                layout = layouts.get((state.analysis.run, rank))
                works, silent = groups.setdefault(
                    layout.peers_key if layout is not None else None, ({}, set()))
                if newest.last_end_t - received.last_end_t > behind_s:
                    silent.add(rank)
                elif received.own_s:
                    works[rank] = _rank_work(received, state.analysis)
                    own[rank] = works[rank].own_s
            standings: dict[int, Standing] = {}
            for works, silent in groups.values():
                standings.update(judge_run(works, frozenset(silent), thresholds))
            for state in states:
                analysis = state.analysis
                standing = standings.get(analysis.rank, Standing())
                key = (analysis.run, analysis.rank)
                update = {"straggler_score": standing.score,
                          "straggler_cause": standing.cause,
                          "slower_rank": standing.slower_rank,
                          "own_work_s": own.get(analysis.rank),
                          "parallel": layouts.get(key)}
                if any(getattr(analysis, name) != value for name, value in update.items()):
                    state.conclude(**update)  # scores are positive: never -0.0 or NaN

    def analyses(self) -> list[RankAnalysis]:
        """Every rank's current analysis (never changed once handed out)."""
        for state, assess, memory in self._oom_unread.values():
            state.conclude(oom=_oom(assess, memory))
        self._oom_unread.clear()
        return [s.analysis for s in self._ranks.trackers()]


def _rank_work(received: Received, analysis: RankAnalysis) -> RankWork:
    """A rank's latest steps, as the straggler comparison reads them, with its GPU's state
    over its latest verdict's window."""
    own = list(received.own_s)
    low, high = (statistics.quantiles(own, n=4, method="inclusive")[::2] if len(own) > 1
                 else (own[0], own[0]))
    data = [d for d in received.data_s if d is not None]
    waits = [w for w in received.cpu_wait_s if w is not None]
    return RankWork(statistics.median(own), statistics.median(data) if data else None,
                    analysis.sm_clock_hz, analysis.gpu_trouble, own_low_s=low, own_high_s=high,
                    step_s=statistics.median(received.step_s), steps=len(own),
                    cpu_wait_s=statistics.median(waits) if waits else None)


def _oom(assess: Callable[[], OomRisk], memory: MemoryAttribution | None) -> OomRisk:
    """The OOM risk, with what fills the memory where it warns."""
    oom = assess()
    if memory is not None and oom.reasons:
        # What is at risk is only half the warning: say which part fills the memory.
        oom = replace(oom, reasons=(*oom.reasons, memory.text))
    return oom


def _delta(previous: StepRecord | None, last: StepRecord, name: str) -> int:
    now = getattr(last.mem, name, None) if last.mem else None
    before = getattr(previous.mem, name, None) if previous and previous.mem else None
    if now is None:
        return 0
    return max(0, now - (before or 0)) if before is not None else 0


__all__ = ["Analysed", "Bottleneck", "RankAnalysis", "RankKey", "RankTracker", "Received",
           "StepAnalyzer", "StepVerdict", "TrackerTable", "Trackers", "attribute_gpu", "new_tracker"]
