"""A step's collective communication read from CUDA events, on a GPU (NCCL): ``DeviceComm``,
a ``Deferred`` the sender resolves once the GPU has passed every event the ledger and the
watchers recorded (``comm.ops.record_event``). Why events, and which: docs/architecture.md §5.1 (on a GPU).
"""

from __future__ import annotations

from typing import Any

from gpumon.client.comm.intervals import union_seconds
from gpumon.client.comm.ops import NO_EVENT, Op, Tail
from gpumon.client.comm.tapped import RECEIVES


class DeviceComm:
    """A step's ``comm`` from CUDA events; a ``Deferred`` the sender resolves once the GPU
    has passed every event."""

    __slots__ = ("_clock", "_ops", "_tails", "_duration_s", "_released")

    def __init__(self, clock: Any, ops: list[Op], tails: list[Tail], duration_s: float) -> None:
        self._clock = clock
        self._ops = ops
        self._tails = tails
        self._duration_s = duration_s
        self._released = False

    def _events(self) -> list[Any]:
        """Every event of the step, read afresh: a completion's is recorded by a callback that
        may run after the step ended (``None`` until then)."""
        if self._released:
            return []
        return [e for op in self._ops for e in op.events or ()] + [e for t in self._tails for e in t.events]

    def ready(self) -> bool:
        events = self._events()
        if any(e is NO_EVENT for e in events):
            return True  # value() is None: the field is left out, and counted
        if any(e is None for e in events):  # a completion not seen yet: not ready
            return False
        try:
            return all(self._clock.passed(e) for e in events)
        except Exception:
            return True  # value() finds the failure and leaves the field out

    def value(self) -> dict[str, object] | None:
        """The wire's ``comm`` figures in GPU seconds, bounded by the step's duration."""
        figures = None
        if not any(e is NO_EVENT for e in self._events()):
            try:
                figures = self._figures()
            except Exception:
                pass
        self.abandon()
        return figures

    def abandon(self) -> None:
        """Give the events back (those the GPU has passed: the rest may still be recorded)."""
        clock = self._clock
        for event in self._events():
            if event is not None and event is not NO_EVENT:
                try:
                    if clock.passed(event):
                        clock.release(event)
                except Exception:
                    pass
        self._released = True

    def _figures(self) -> dict[str, object] | None:
        clock = self._clock
        origin = self._events()[0]

        def at(event: Any) -> float:
            return float(clock.elapsed_s(origin, event))

        busy: list[tuple[float, float]] = []
        kinds: dict[str, list[Any]] = {}
        for op in self._ops:
            start, end = (at(e) for e in op.events)  # type: ignore[union-attr]
            busy.append((start, end))
            figures = kinds.setdefault(op.name, [0, 0, 0.0])
            figures[0] += 1
            figures[1] += op.nbytes
            figures[2] += max(0.0, end - start)
        waits = [(at(t.events[0]), at(t.events[1])) for t in self._tails]
        lo = min(a for a, _ in busy + waits)
        hi = max(b for _, b in busy + waits)
        unseen_s = 0.0
        for tail, (_, resumed) in zip(self._tails, waits, strict=True):
            ends = [b for _, b in busy if b <= resumed]
            if tail.mirrored and ends:
                unseen_s += resumed - max(ends)
        duration = self._duration_s
        exposed = min(duration, union_seconds(waits, lo, hi) + unseen_s)
        out: dict[str, object] = {
            "exposed": exposed,
            "busy": min(duration, max(exposed, union_seconds(busy + waits, lo, hi) + unseen_s)),
            "ops": {name: [count, size, seconds] for name, (count, size, seconds) in kinds.items()},
        }
        if any(op.name in RECEIVES for op in self._ops):
            receiving = [w for w, tail in zip(waits, self._tails, strict=True) if tail.receiving]
            out["bubble"] = min(exposed, union_seconds(receiving, lo, hi))
        return out
