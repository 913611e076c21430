"""Stream a recording through the verdict engine in bounded memory.

``gpumon classify`` holds a recording whole and runs the engine after every step; a day of
64 ranks is millions of steps, more than memory holds and than that takes time for. Here the
file is read twice, line by line through classify's own line parser (``load_recording``), and
nothing grows with its length:

1. the scan: the runs there are, the run's first and last times, a sample of its step times
   (for the time bins), the GPUs, the sampling interval, each rank's layout (its hello's place
   in the job's parallelism), where each rank's time went (its latest ``time`` line) and the
   lines skipped;
2. the replay: the run's steps, put back into the order they ended within ``REORDER_S`` (an
   agent appends them as their datagrams arrive), go to the engine as the live agent feeds
   it, with ``StepAnalyzer.process`` run once per sampling interval of the recording's time,
   as the agent's schedule runs it, with every rank's layout from the start (as ``gpumon
   classify`` gives them, having read the whole file), so that a rank is compared with its
   data-parallel replicas; GPU samples are kept for ``HISTORY_S``.

The engine merges steps shorter than its resolution into one window. Over a long run a time
bin of the page spans many sampling intervals, so the resolution is raised to a fraction of a
bin (``min_window_s``): the verdicts come per window of that length, which the page could not
show finer, and the engine's calls follow the page's bins rather than the run's steps.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from gpumon.analysis.goodput import TimeTotals
from gpumon.analysis.stream import RankAnalysis, StepAnalyzer, StepVerdict
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.commands.classify import load_recording
from gpumon.wire import ParallelLayout, StepRecord

REORDER_S = 30.0
"""How late in the file a step may come after steps that ended after it."""
HISTORY_S = 300.0
"""GPU samples kept behind the latest step: far more than any step's window."""
SAMPLED_DURATIONS = 20_000
"""Step times kept to size the time bins (every n-th, n doubling as they come)."""


@dataclass
class Scan:
    """What the first pass learns."""

    runs: Counter[str] = field(default_factory=Counter)
    start: dict[str, float] = field(default_factory=dict)
    end: dict[str, float] = field(default_factory=dict)
    durations: dict[str, list[float]] = field(default_factory=dict)
    statics: dict[int, GpuStatic] = field(default_factory=dict)
    layouts: dict[tuple[str, int], ParallelLayout] = field(default_factory=dict)
    """(run, rank) → its place in the job's parallelism, from its latest hello."""
    times: dict[tuple[str, int], tuple[float, TimeTotals]] = field(default_factory=dict)
    """(run, rank) → where its time went, from its latest ``time`` line: (unix time, figures)."""
    gaps: list[float] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    skipped_at: list[int] = field(default_factory=list)
    """Line numbers (from 1) of the first skipped lines."""


def parsed(lines: Iterable[str], scan: Scan | None = None,
           shown: int = 10) -> Iterator[StepRecord | GpuSample]:
    """Each usable line as classify reads it; a skipped line is counted in ``scan``, a hello's
    layout kept there."""
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        one = load_recording([text])
        if one.skipped:
            if scan is not None:
                scan.skipped.update(one.skipped)
                if len(scan.skipped_at) < shown:
                    scan.skipped_at.append(number)
            continue
        if one.steps:
            yield one.steps[0]
        if scan is not None:
            scan.layouts.update(one.layouts)
            for key, (t, totals) in one.times.items():
                if t >= scan.times.get(key, (float("-inf"),))[0]:
                    scan.times[key] = (t, totals)
        for index, samples in one.samples.items():
            if scan is not None and index not in scan.statics:
                scan.statics[index] = one.statics[index]
            yield from samples


def scan(lines: Iterable[str]) -> Scan:
    """The first pass."""
    found = Scan()
    last_t: dict[int, float] = {}
    strides: dict[str, int] = {}
    for item in parsed(lines, found):
        if isinstance(item, GpuSample):
            previous = last_t.get(item.index)
            if previous is not None and item.t > previous and len(found.gaps) < 1000:
                found.gaps.append(item.t - previous)
            last_t[item.index] = item.t
            continue
        if item.t_start is None:
            continue
        run = item.run
        found.runs[run] += 1
        found.start[run] = min(found.start.get(run, item.t_start), item.t_start)
        found.end[run] = max(found.end.get(run, item.t_start), item.t_start + item.duration_s)
        kept = found.durations.setdefault(run, [])
        stride = strides.setdefault(run, 1)
        if found.runs[run] % stride == 0:
            kept.append(item.duration_s)
            if len(kept) >= SAMPLED_DURATIONS:
                del kept[::2]
                strides[run] = stride * 2
    return found


class _Samples:
    """A GPU's recent samples, oldest first, trimmed to ``HISTORY_S``."""

    def __init__(self) -> None:
        self.samples: list[GpuSample] = []
        self.times: list[float] = []

    def add(self, sample: GpuSample) -> None:
        if self.times and sample.t < self.times[-1]:
            i = bisect_right(self.times, sample.t)
            self.samples.insert(i, sample)
            self.times.insert(i, sample.t)
        else:
            self.samples.append(sample)
            self.times.append(sample.t)

    def trim(self, before: float) -> None:
        cut = bisect_left(self.times, before)
        if cut > 1024:
            del self.samples[:cut], self.times[:cut]

    def window(self, t0: float, t1: float) -> list[GpuSample]:
        return self.samples[bisect_left(self.times, t0):bisect_right(self.times, t1)]


def replay(lines: Iterable[str], run: str, found: Scan,
           on_step: Callable[[StepRecord], None],
           on_sample: Callable[[GpuSample], None],
           on_verdict: Callable[[StepVerdict, float], None],
           min_window_s: float = 0.0) -> list[RankAnalysis]:
    """The second pass: every step of ``run`` to ``on_step`` in the order they ended, every GPU
    sample to ``on_sample``, every verdict to ``on_verdict`` with when its last step ended;
    returns the engine's last analysis of each rank (its OOM risk)."""
    resolution = max(statistics.median(found.gaps) if found.gaps else 1.0, min_window_s)
    analyzer = StepAnalyzer(resolution_s=resolution)
    gpus: dict[int, _Samples] = {}
    statics = list(found.statics.values())
    order = itertools.count()
    heap: list[tuple[float, int, StepRecord]] = []
    ends: dict[tuple[int, int], float] = {}
    state = {"processed": -float("inf"), "latest": -float("inf")}

    def history(index: int, t0: float, t1: float) -> list[GpuSample]:
        held = gpus.get(index)
        return held.window(t0, t1) if held is not None else []

    def process(now: float) -> None:
        latest = {i: g.samples[max(bisect_right(g.times, now) - 1, 0)]
                  for i, g in gpus.items() if g.samples}
        for verdict in analyzer.process(now, history, statics, latest, found.layouts):
            last = max((ends.pop((verdict.rank, s), now) for s in verdict.steps), default=now)
            on_verdict(verdict, last)
        state["processed"] = now
        for held in gpus.values():
            held.trim(now - HISTORY_S)

    def release(until: float) -> None:
        while heap and heap[0][0] <= until:
            end, _, step = heapq.heappop(heap)
            on_step(step)
            ends[(step.rank, step.step)] = end
            analyzer.add([step], received_t=end)
            if end - state["processed"] >= resolution:
                process(end)

    for item in parsed(lines):
        if isinstance(item, GpuSample):
            gpus.setdefault(item.index, _Samples()).add(item)
            on_sample(item)
            continue
        if item.run != run or item.t_start is None:
            continue
        end = item.t_start + item.duration_s
        heapq.heappush(heap, (end, next(order), item))
        state["latest"] = max(state["latest"], end)
        release(state["latest"] - REORDER_S)
    release(float("inf"))
    process(float("inf"))
    return analyzer.analyses()
