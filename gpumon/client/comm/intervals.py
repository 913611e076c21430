"""Interval arithmetic for the communication figures: the union of intervals inside a window,
and the contention a training thread's clock readings show (docs/architecture.md §5.1)."""

from __future__ import annotations

import itertools

MIN_QUIET_WALL_S = 1e-9
"""Working time with no collective in flight below which a step has no off-CPU rate of its own
(taken as 0): a rate read off a rounding error's worth of wall time is noise, and it flips
the contention of a step that was in flight throughout between none and all of it."""


def contention_seconds(clocks: list[tuple[float, float]], busy: list[tuple[float, float]],
                       blocked: list[tuple[float, float]]) -> float:
    """Seconds the training thread spent off a CPU, while not blocked, because collectives
    were in flight (the contention of docs/architecture.md §5.1).

    ``clocks`` are (wall, CPU clock) readings of the training thread; between two consecutive
    ones it either waited on communication (the span touches ``blocked``: left out, the wait
    is counted already) or worked. A working span's time off a CPU is split by the share of
    it some collective was in flight (``busy``); the rest sets the off-CPU rate the step had
    without them, which is subtracted."""
    quiet_wall = quiet_off = 0.0
    spans: list[tuple[float, float, float]] = []  # (wall, off a CPU, share in flight)
    readings = sorted(clocks)
    in_blocked, in_busy = _Sweep(blocked), _Sweep(busy)  # the spans come in order
    for (wa, ca), (wb, cb) in itertools.pairwise(readings):
        wall = wb - wa
        if wall <= 0.0 or in_blocked.seconds(wa, wb) > 0.0:
            continue
        off = max(0.0, wall - (cb - ca))
        in_flight = in_busy.seconds(wa, wb) / wall
        spans.append((wall, off, in_flight))
        quiet_wall += wall * (1.0 - in_flight)
        quiet_off += off * (1.0 - in_flight)
    rate = quiet_off / quiet_wall if quiet_wall > MIN_QUIET_WALL_S else 0.0
    return max(0.0, sum((off - rate * wall) * in_flight for wall, off, in_flight in spans))


class _Sweep:
    """The union of intervals, asked how much of it lies in windows that come in order (each
    window starting at or after the last one's start): one pass over the intervals in all."""

    def __init__(self, intervals: list[tuple[float, float]]) -> None:
        merged: list[list[float]] = []
        for start, stop in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            elif stop > start:
                merged.append([start, stop])
        self._merged = merged
        self._first = 0  # intervals before this one end before every window still to come

    def seconds(self, lo: float, hi: float) -> float:
        merged, i = self._merged, self._first
        while i < len(merged) and merged[i][1] <= lo:
            i += 1
        self._first = i
        total = 0.0
        while i < len(merged) and merged[i][0] < hi:
            total += min(merged[i][1], hi) - max(merged[i][0], lo)
            i += 1
        return total


def last_end(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """The last end of ``intervals`` clipped to [lo, hi]; ``lo`` when there are none."""
    return max((min(b, hi) for _, b in intervals if b > lo), default=lo)


def union_seconds(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi]."""
    total = 0.0
    reach = lo
    for start, stop in sorted(intervals):
        start = max(start, reach)
        stop = min(stop, hi)
        if stop > start:
            total += stop - start
            reach = stop
    return total
