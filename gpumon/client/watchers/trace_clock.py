"""The clock a trace arms in place of the core's CUDA clock: every phase boundary a host-clock
reading (``perf_counter``), carrying the CUDA event where there is one. The core times a phase
from that very reading, so a phase's range in the trace and its seconds in the step's record
are one measurement."""

from __future__ import annotations

from time import perf_counter
from typing import Any


class TraceEvent(float):
    """A phase boundary while tracing: its host time (the float itself, which the core takes as
    its own reading of the boundary) and the CUDA event."""

    __slots__ = ("inner",)
    inner: Any

    def __new__(cls, t: float, inner: Any) -> TraceEvent:
        event = super().__new__(cls, t)
        event.inner = inner
        return event


class TraceClock:
    """Stands in for the core's CUDA clock while a trace is armed: every step is timed at
    each phase boundary (``device_interval_s`` 0), each boundary stamped with ``perf_counter``
    and, on CUDA, with the real clock's event. The sender keeps it as its clock for good: it
    collects the stamped phases it resolves and passes the rest to the real clock."""

    device_interval_s = 0.0
    share_gap_s = 0.0  # every phase gets its own start stamp

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        if inner is None:
            # Without CUDA a boundary is the clock's reading alone. A builtin, so the core's
            # call runs no Python frame, where another thread could take the GIL between the
            # core's reading and this one and stretch the range by milliseconds.
            self.event = perf_counter  # type: ignore[method-assign,assignment]
        self.device_next = False  # a step ended timed: the next one is stamped too
        self.collect: list[tuple[str, float, float]] | None = None

    def event(self) -> TraceEvent:
        inner = self.inner
        return TraceEvent(perf_counter(), None if inner is None else inner.event())

    def memory(self) -> Any:
        self.device_next = True
        return None if self.inner is None else self.inner.memory()

    def read_memory(self) -> Any:
        return None if self.inner is None else self.inner.read_memory()

    def resolve(self, marks: list[Any]) -> dict[str, float] | None:
        collect = self.collect
        if collect is not None:
            for name, start, end in marks:
                t0, t1 = _stamp(start), _stamp(end)
                if t0 is not None and t1 is not None:
                    collect.append((name, t0, t1))
        if self.inner is None:
            return {}
        phases: dict[str, float] | None = self.inner.resolve(
            [(name, _inner(start), _inner(end)) for name, start, end in marks])
        return phases

    def __getattr__(self, name: str) -> Any:  # the rest of CudaClock's surface
        return getattr(self.inner, name)


def _stamp(event: Any) -> float | None:
    return float(event) if isinstance(event, float) else None


def _inner(event: Any) -> Any:
    return event.inner if isinstance(event, TraceEvent) else event
