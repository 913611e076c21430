"""Stream a recording through the verdict engine in bounded memory.

``gpumon classify`` holds a recording whole and runs the engine after every step; a day of
64 ranks is millions of steps, more than memory holds and than that takes time for. Here the
file is read twice, a line at a time, and nothing grows with its length:

1. the scan: the runs there are, the run's first and last times, a sample of its step times
   (for the time bins), the GPUs, the sampling interval, each rank's layout (its hello's place
   in the job's parallelism), where each rank's time went (its latest ``time`` line) and the
   lines skipped. ``quick_scan`` guesses it from the text of the lines in the agent's own
   form; the replay makes ``scan``'s, from every line through the records' checks, and the
   report is kept only where the two agree (else replayed from the checked one);
2. the replay, every line through classify's own line parser (``parse_line``): the run's
   steps, put back into the order they ended within ``REORDER_S`` (an
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
import re
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpumon.analysis.goodput import TimeTotals
from gpumon.analysis.stream import RankAnalysis, StepAnalyzer, StepVerdict
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.commands.classify import keep_latest, parse_line, static_from_line
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
    _strides: dict[str, int] = field(default_factory=dict, repr=False)
    _last_t: dict[int, float] = field(default_factory=dict, repr=False)

    def step(self, run: str, t_start: float, duration_s: float) -> None:
        """A step of ``run`` with a start: the run's span, and a sample of its step times."""
        count = self.runs[run] = self.runs[run] + 1
        if count == 1:
            self.start[run] = self.end[run] = t_start
            self.durations[run] = []
            self._strides[run] = 1
        # min(start, t_start) and max(end, t_start + duration_s), as the builtins choose
        # (the first unless the second is smaller or larger), a million times over
        start, end = self.start[run], t_start + duration_s
        if t_start < start:
            self.start[run] = t_start
        if end > self.end[run]:
            self.end[run] = end
        stride = self._strides[run]
        if count % stride == 0:
            kept = self.durations[run]
            kept.append(duration_s)
            if len(kept) >= SAMPLED_DURATIONS:
                del kept[::2]
                self._strides[run] = stride * 2

    def gpu(self, index: int, t: float) -> None:
        """A GPU sample: the sampling interval."""
        previous = self._last_t.get(index)
        if previous is not None and t > previous and len(self.gaps) < 1000:
            self.gaps.append(t - previous)
        self._last_t[index] = t

    def note(self, number: int, kind: str, value: Any, shown: int = 10) -> None:
        """What a line other than a step or a GPU sample says: a skip, a layout, a time line."""
        if kind == "skip":
            self.skipped[value] += 1
            if len(self.skipped_at) < shown:
                self.skipped_at.append(number)
        elif kind == "hello" and value is not None:
            key, layout = value
            self.layouts[key] = layout
        elif kind == "time":
            keep_latest(self.times, value)


def parsed(lines: Iterable[str], scan: Scan | None = None) -> Iterator[StepRecord | GpuSample]:
    """Each usable line as classify reads it (``parse_line``); what a line other than a step
    or a GPU sample says, and a GPU's first line, go to ``scan``."""
    for number, text in enumerate(lines, start=1):
        kind, value = parse_line(text)
        if kind == "step":
            yield value
        elif kind == "gpu":
            sample, line = value
            if scan is not None and sample.index not in scan.statics:
                scan.statics[sample.index] = static_from_line(sample.index, line)
            yield sample
        elif scan is not None:
            scan.note(number, kind, value)


def scan(lines: Iterable[str]) -> Scan:
    """The first pass, every line read as the replay reads it."""
    found = Scan()
    for item in parsed(lines, found):
        if isinstance(item, GpuSample):
            found.gpu(item.index, item.t)
        elif item.t_start is not None:
            found.step(item.run, item.t_start, item.duration_s)
    return found


_STEP_LINE = re.compile(r'\{"v":1,"kind":"step","run":"([^"\\]+)",[^{}]*?'
                        r'"t_start":(\d[\d.eE+-]*),"duration":(\d[\d.eE+-]*)[,}]')
_GPU_LINE = re.compile(r'\{"kind":"gpu","t":(\d[\d.eE+-]*),"gpu":(\d+)[,}]')
"""Step and GPU lines as the agent writes them (``agent/recorder.py``): what the quick scan reads
from the text, without parsing the JSON."""


def quick_scan(lines: Iterable[str]) -> Scan:
    """The first pass, guessed: a step's run, start and duration and a GPU line's index and
    time read from the text where the line has the agent's own form (``_STEP_LINE``,
    ``_GPU_LINE``), other lines parsed. A day of 64 ranks is 1.8 million lines; parsing each
    twice was a third of the report's time. The replay reads every line through the records'
    checks and makes ``scan``'s own from them (``replay``'s ``check``): the caller keeps the
    report only where the two are equal, and replays again from the replay's otherwise."""
    found = Scan()
    for number, text in enumerate(lines, start=1):
        match = _STEP_LINE.match(text)
        if match is not None:
            found.step(match[1], float(match[2]), float(match[3]))
            continue
        match = _GPU_LINE.match(text)
        if match is not None and int(match[2]) in found.statics:
            found.gpu(int(match[2]), float(match[1]))
            continue
        kind, value = parse_line(text)
        if kind == "step" and value.t_start is not None:
            found.step(value.run, value.t_start, value.duration_s)
        elif kind == "gpu":
            sample, line = value
            found.gpu(sample.index, sample.t)
            if sample.index not in found.statics:
                found.statics[sample.index] = static_from_line(sample.index, line)
        else:
            found.note(number, kind, value)
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


def in_order(lines: Iterable[str], run: str,
             check: Scan | None = None) -> Iterator[GpuSample | tuple[float, StepRecord]]:
    """Every GPU sample as it comes, and every step of ``run`` as (its end, it) in the order
    the steps ended (within ``REORDER_S``): the order ``replay`` feeds its callbacks in, which
    the bins' sums depend on. ``check`` gets what ``scan`` finds."""
    order = itertools.count()
    heap: list[tuple[float, int, StepRecord]] = []
    latest = -float("inf")
    for item in parsed(lines, check):
        if isinstance(item, GpuSample):
            if check is not None:
                check.gpu(item.index, item.t)
            yield item
            continue
        if check is not None and item.t_start is not None:
            check.step(item.run, item.t_start, item.duration_s)
        if item.run != run or item.t_start is None:
            continue
        end = item.t_start + item.duration_s
        heapq.heappush(heap, (end, next(order), item))
        if end > latest:
            latest = end
        until = latest - REORDER_S
        while heap and heap[0][0] <= until:
            end, _, step = heapq.heappop(heap)
            yield end, step
    while heap:
        end, _, step = heapq.heappop(heap)
        yield end, step


def replay(lines: Iterable[str], run: str, found: Scan,
           on_step: Callable[[StepRecord], None] | None,
           on_sample: Callable[[GpuSample], None] | None,
           on_verdict: Callable[[StepVerdict, float], None],
           min_window_s: float = 0.0, check: Scan | None = None) -> list[RankAnalysis]:
    """The second pass: every step of ``run`` to ``on_step`` in the order they ended, every GPU
    sample to ``on_sample`` (either may be None: the bins filled elsewhere), every verdict to
    ``on_verdict`` with when its last step ended; returns the engine's last analysis of each
    rank (its OOM risk, the only one read: assessed once, at the end, ``StepAnalyzer``'s
    ``oom_when_read``). ``check`` gets what ``scan`` finds, from the lines as the replay reads
    them."""
    resolution = max(statistics.median(found.gaps) if found.gaps else 1.0, min_window_s)
    analyzer = StepAnalyzer(resolution_s=resolution, oom_when_read=True)
    gpus: dict[int, _Samples] = {}
    statics = list(found.statics.values())
    ends: dict[tuple[int, int], float] = {}
    processed = -float("inf")

    def history(index: int, t0: float, t1: float) -> list[GpuSample]:
        held = gpus.get(index)
        return held.window(t0, t1) if held is not None else []

    def process(now: float) -> None:
        latest = {i: g.samples[max(bisect_right(g.times, now) - 1, 0)]
                  for i, g in gpus.items() if g.samples}
        for verdict in analyzer.process(now, history, statics, latest, found.layouts):
            last = max((ends.pop((verdict.rank, s), now) for s in verdict.steps), default=now)
            on_verdict(verdict, last)
        for held in gpus.values():
            held.trim(now - HISTORY_S)

    for item in in_order(lines, run, check):
        if isinstance(item, GpuSample):
            held = gpus.get(item.index)
            if held is None:  # not setdefault: that makes a _Samples for every sample
                held = gpus[item.index] = _Samples()
            held.add(item)
            if on_sample is not None:
                on_sample(item)
            continue
        end, step = item
        if on_step is not None:
            on_step(step)
        ends[(step.rank, step.step)] = end
        analyzer.add([step], received_t=end)
        if end - processed >= resolution:
            process(end)
            processed = end
    process(float("inf"))
    return analyzer.analyses()
