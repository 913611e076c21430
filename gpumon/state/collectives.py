"""Per-rank totals of collective communication, folded from step records as they arrive.

Counters (exposed and overlapped seconds, and per collective kind the count, bytes and
seconds) so that Prometheus can take rates over any window; and, per kind, the achieved bus
bandwidth over the rank's last few steps that ran it, which needs the world size at the time
and so is computed here rather than in a query. Figures are immutable and replaced on each
step, so the copy a scrape renders from is a dict copy, not a copy of the recent window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpumon.analysis.comm import bus_bandwidth_factor, overlapped_s, wait_s
from gpumon.wire import StepRecord

BANDWIDTH_STEPS = 16
"""Steps (of those that ran a kind of collective) its bus bandwidth is measured over."""


@dataclass(frozen=True, slots=True)
class OpFigures:
    """One kind of collective on one rank, so far."""

    count: int
    bytes: int
    seconds: float
    bus_bytes_per_second: float | None
    """Achieved bus bandwidth over the recent steps (nccl-tests' definition: bytes ÷ seconds
    × the kind's factor at the world size those steps reported); ``None`` when unknown."""


@dataclass
class CommTotals:
    """Everything one rank's steps said about its collectives."""

    exposed_seconds: float = 0.0
    """Seconds blocked on collectives: measured, or a hand-timed ``comm`` phase when larger."""
    overlapped_seconds: float = 0.0
    """Seconds collectives were in flight beyond that wait (hidden behind compute)."""
    measured: bool = False
    """Whether any step carried measured communication (not only a ``comm`` phase)."""
    ops: dict[str, OpFigures] = field(default_factory=dict)
    bubble_seconds: float | None = None
    """Of the exposed seconds, those spent waiting to receive from another rank (a pipeline
    stage's bubble); ``None`` until a step reports any."""
    _recent: dict[str, _Window] = field(default_factory=dict, repr=False, compare=False)

    def add(self, step: StepRecord) -> None:
        """Fold one step in (one whose ``comm.wait_s`` is known)."""
        self.exposed_seconds += wait_s(step) or 0.0
        overlapped = overlapped_s(step)
        if overlapped is None or step.comm is None:
            return
        self.measured = True
        self.overlapped_seconds += overlapped
        if step.comm.bubble_s is not None:
            self.bubble_seconds = (self.bubble_seconds or 0.0) \
                + min(step.comm.bubble_s, step.comm.exposed_s)
        for op in step.comm.ops:
            recent = self._recent.get(op.name)
            if recent is None:
                recent = self._recent[op.name] = _Window()
            recent.add(op.bytes, op.seconds)
            before = self.ops.get(op.name)
            factor = bus_bandwidth_factor(op.name, step.world)
            bus = (recent.bytes / recent.seconds * factor
                   if factor is not None and recent.seconds > 0 else None)
            self.ops[op.name] = OpFigures(
                (before.count if before else 0) + op.count,
                (before.bytes if before else 0) + op.bytes,
                (before.seconds if before else 0.0) + op.seconds, bus)

    def copy(self) -> CommTotals:
        """A copy for rendering, which later steps do not change (without the recent window)."""
        return CommTotals(self.exposed_seconds, self.overlapped_seconds, self.measured,
                          dict(self.ops), self.bubble_seconds)


class _Window:
    """The last ``BANDWIDTH_STEPS`` (bytes, seconds) of one kind, with their running sums."""

    __slots__ = ("steps", "bytes", "seconds")

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque()
        self.bytes = 0
        self.seconds = 0.0

    def add(self, size: int, seconds: float) -> None:
        if len(self.steps) == BANDWIDTH_STEPS:
            old_size, old_seconds = self.steps.popleft()
            self.bytes -= old_size
            self.seconds = max(0.0, self.seconds - old_seconds)
        self.steps.append((size, seconds))
        self.bytes += size
        self.seconds += seconds
