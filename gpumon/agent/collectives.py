"""Per-rank totals of collective communication, folded from step records as they arrive.

Counters (exposed and overlapped seconds, and per collective kind the count, bytes and
seconds) so that Prometheus can take rates over any window; and, per kind, the achieved bus
bandwidth over the rank's last few steps that ran it, which needs the world size at the time
and so is computed here rather than in a query.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpumon.analysis.comm import bus_bandwidth_factor, overlapped_s, wait_s
from gpumon.wire import StepRecord

BANDWIDTH_STEPS = 16
"""Steps (of those that ran a kind of collective) its bus bandwidth is measured over."""


@dataclass
class OpTotals:
    """One kind of collective on one rank."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=BANDWIDTH_STEPS))
    """(bytes, seconds) of its last ``BANDWIDTH_STEPS`` steps."""

    def bus_bytes_per_second(self, op: str, world: int | None) -> float | None:
        """Achieved bus bandwidth over the recent steps (nccl-tests' definition:
        bytes ÷ seconds × the kind's factor for ``world`` ranks); ``None`` when unknown."""
        factor = bus_bandwidth_factor(op, world)
        seconds = sum(s for _, s in self.recent)
        if factor is None or seconds <= 0:
            return None
        return sum(b for b, _ in self.recent) / seconds * factor


@dataclass
class CommTotals:
    """Everything one rank's steps said about its collectives."""

    exposed_seconds: float = 0.0
    """Seconds blocked on collectives: measured, or a hand-timed ``comm`` phase when larger."""
    overlapped_seconds: float = 0.0
    """Seconds collectives were in flight beyond that wait (hidden behind compute)."""
    measured: bool = False
    """Whether any step carried measured communication (not only a ``comm`` phase)."""
    ops: dict[str, OpTotals] = field(default_factory=dict)

    def add(self, step: StepRecord) -> None:
        """Fold one step in (one whose ``comm.wait_s`` is known)."""
        self.exposed_seconds += wait_s(step) or 0.0
        overlapped = overlapped_s(step)
        if overlapped is None or step.comm is None:
            return
        self.measured = True
        self.overlapped_seconds += overlapped
        for op in step.comm.ops:
            totals = self.ops.get(op.name)
            if totals is None:
                totals = self.ops[op.name] = OpTotals()
            totals.count += op.count
            totals.bytes += op.bytes
            totals.seconds += op.seconds
            totals.recent.append((op.bytes, op.seconds))

    def copy(self) -> CommTotals:
        """A copy that later steps do not change (for rendering outside the store's lock)."""
        return CommTotals(self.exposed_seconds, self.overlapped_seconds, self.measured,
                          {name: OpTotals(t.count, t.bytes, t.seconds, deque(t.recent,
                                                                              BANDWIDTH_STEPS))
                           for name, t in self.ops.items()})
