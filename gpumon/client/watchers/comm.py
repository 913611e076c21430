"""Collective communication measured on the host, per step: the ledger a watched model's
monitor keeps (``CommLedger``, the monitor's step extension), the collectives it records
(``Op``) and the training thread's waits for them (``Tail``).

How and why it measures what it does (busy, exposed, contention; which step an operation
belongs to; what is not measured): docs/architecture.md §5.1. The same figures from CUDA events
on a GPU are ``comm_device``'s; the interval arithmetic both use is ``comm_intervals``'.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from time import perf_counter, thread_time
from typing import Any

from gpumon.client.watchers.comm_device import NO_EVENT, DeviceComm, record_event
from gpumon.client.watchers.comm_intervals import contention_seconds, last_end, union_seconds

__all__ = ["MAX_PENDING_OPS", "NO_EVENT", "CommLedger", "DeviceComm", "Op", "Tail",
           "contention_seconds", "record_event", "union_seconds"]

MAX_PENDING_OPS = 4096
"""Operations kept in flight across step ends; beyond that the oldest are dropped and counted
(a collective that never completes, such as a peer that died, must not grow memory)."""

class Op:
    """One collective: launched on some thread, completed (``t_done``) on another."""

    __slots__ = ("name", "nbytes", "t0", "t1", "t_done", "counted_until", "on_training_thread",
                 "events")

    def __init__(self, name: str, nbytes: int, t0: float, t1: float, on_training_thread: bool) -> None:
        self.name = name
        self.nbytes = nbytes
        self.t0 = t0  # launch call entered
        self.t1 = t1  # launch call returned
        self.t_done: float | None = None
        self.counted_until = t0  # busy time before this was reported with an earlier step
        self.on_training_thread = on_training_thread
        self.events: list[Any] | None = None  # CUDA events at launch and completion, on a GPU

    def done(self, _future: object = None) -> None:
        """Stamp the completion (called from the thread that completes the work)."""
        self.t_done = perf_counter()

    def device_done(self, clock: Any) -> None:
        """Stamp the completion on the GPU: an event on the current stream, which the work's
        end gates (a CUDA future's callback runs on streams made to wait for it)."""
        self.t_done = perf_counter()
        if self.events is not None:
            self.events[1] = record_event(clock)


class Tail:
    """A wait of the training thread from ``start`` until its step's operations completed,
    or until ``end``, stamped by a callback that ran when the waiter resumed.

    With ``mirrored``, the work between the last completion and ``end`` (DDP copying each
    bucket back into the gradients) was done once before too, unseen (DDP copying each
    gradient into its bucket as it became ready, inside backward): the same bytes, so it is
    taken to have cost the same, and counted as exposed once more. Where no copy is made
    (``gradient_as_bucket_view=True``) both are nil.
    """

    __slots__ = ("start", "end", "cpu_end", "mirrored", "clock", "events")

    def __init__(self, start: float, mirrored: bool = False, clock: Any = None) -> None:
        self.start = start
        self.end: float | None = None
        self.cpu_end: float | None = None  # the waiter's CPU clock at ``end``
        self.mirrored = mirrored
        self.clock = clock  # a CudaClock when the wait is on a GPU stream
        self.events: list[Any] = [None, None]

    def waiting(self) -> None:
        """On a GPU: the wait's start, once the last work it follows is queued."""
        if self.clock is not None:
            self.events[0] = record_event(self.clock)

    def resumed(self) -> None:
        """Stamp ``end``; called on the waiting thread."""
        self.end = perf_counter()
        self.cpu_end = thread_time()
        if self.clock is not None:
            self.events[1] = record_event(self.clock)

    def interval(self, ops: Iterable[Op]) -> tuple[float, float] | None:
        """When the wait was, if it can be told."""
        ends = [op.t_done for op in ops if op.t_done is not None]
        if self.end is not None:
            return (self.start, self.end)
        return (self.start, max(ends)) if ends else None

    def unseen_s(self, ops: Iterable[Op]) -> float:
        """Seconds of the mirrored work done before the wait (0 unless ``mirrored``)."""
        if not self.mirrored or self.end is None:
            return 0.0
        ends = [op.t_done for op in ops if op.t_done is not None and op.t_done <= self.end]
        return self.end - max(ends) if ends else 0.0


class CommLedger:
    """Per-monitor accounting of the collectives of each step; the monitor's step extension.

    ``step_begin``/``step_end`` run on the training thread; ``Op.done`` on whichever thread
    completes the work. ``step_end`` adds ``fields["comm"]`` in the wire shape.
    """

    def __init__(self, device_clock: Callable[[], Any] | None = None) -> None:
        self.device_clock = device_clock or (lambda: None)
        """The monitor's ``CudaClock`` once it has one, for collectives on a GPU."""
        self._lock = threading.Lock()  # launches from several threads (a hook's chained collective)
        self._ops: list[Op] = []
        self._blocked: list[tuple[float, float]] = []
        self._tails: list[Tail] = []
        self._clocks: list[tuple[float, float]] = []  # (wall, thread CPU) of the training thread
        self._t_begin: float | None = None
        self.step_token: object = None
        """A new object at each step's start: tells a step from the one before."""
        self._thread: int | None = None
        self._untimed = False
        self._device_timed = False
        self.blind = False
        """Some watched communication cannot be seen (a built-in C++ comm hook): report none."""
        self.infer_tail = False
        """Treat the step's last launch as the start of a wait for everything launched in the
        step (true of DDP with a comm hook that cannot be wrapped)."""
        self.steps_measured = 0
        self.steps_not_timed = 0
        self.outside_steps = 0
        self.dropped_ops = 0

    @property
    def in_step(self) -> bool:
        return self._t_begin is not None

    def step_begin(self) -> None:
        """A step starts on the calling thread (the training thread)."""
        self._t_begin = perf_counter()
        self.step_token = object()
        self._clocks = [(self._t_begin, thread_time())]
        self._thread = threading.get_ident()
        self._blocked = []
        self._tails = []
        self._untimed = False
        self._device_timed = False

    def launched(self, name: str, nbytes: int, t0: float, t1: float, host_timed: bool,
                 cpu: tuple[float, float] | None = None, device_start: Any = None) -> Op | None:
        """Record a collective launched over [t0, t1] (``cpu``: the calling thread's CPU clock
        at both); None when outside a step. One on a GPU (not ``host_timed``) is timed by its
        events, ``device_start`` the one recorded at its launch (else it is not timed)."""
        if self._t_begin is None:
            self.outside_steps += 1
            return None
        on_training_thread = threading.get_ident() == self._thread
        op = Op(name, nbytes, t0, t1, on_training_thread)
        with self._lock:
            if not host_timed:
                if device_start is None:
                    self._untimed = True
                else:
                    op.events = [device_start, None]
                    self._device_timed = True
            if on_training_thread:
                self._blocked.append((t0, t1))
                if cpu is not None:
                    self._clocks += ((t0, cpu[0]), (t1, cpu[1]))
            self._ops.append(op)
            if len(self._ops) > MAX_PENDING_OPS:
                del self._ops[0]
                self.dropped_ops += 1
        return op

    def blocked(self, t0: float, t1: float, cpu: tuple[float, float] | None = None) -> None:
        """The training thread was held up by communication over [t0, t1] (``cpu``: its CPU
        clock at both)."""
        if self._t_begin is not None:
            self._blocked.append((t0, t1))
            if cpu is not None:
                self._clocks += ((t0, cpu[0]), (t1, cpu[1]))

    def wait_from(self, start: float, mirrored: bool = False) -> Tail | None:
        """The training thread waits from ``start`` until the step's collectives complete
        (see ``Tail`` for ``mirrored``)."""
        if self._t_begin is None:
            return None
        tail = Tail(start, mirrored, self.device_clock() if self._device_timed else None)
        self._tails.append(tail)
        return tail

    def step_end(self, fields: dict[str, object]) -> None:
        """Close the step: set ``fields["comm"]`` unless a collective could not be timed."""
        t_begin, t_end, cpu_end = self._t_begin, perf_counter(), thread_time()
        self._t_begin = None
        if t_begin is None:
            return
        with self._lock:
            ops, self._ops = self._ops, []
        if self._device_timed:
            self._device_step_end(fields, ops, t_end - t_begin)
            return
        busy: list[tuple[float, float]] = []
        kinds: dict[str, list[Any]] = {}
        carried = []
        for op in ops:
            done = op.t_done
            start = max(op.counted_until, t_begin)
            stop = t_end if done is None or done > t_end else done
            if stop > start:
                busy.append((start, stop))
            if done is None or done > t_end:
                op.counted_until = t_end
                carried.append(op)
                continue
            figures = kinds.get(op.name)
            if figures is None:
                figures = kinds[op.name] = [0, 0, 0.0]
            figures[0] += 1
            figures[1] += op.nbytes
            figures[2] += max(0.0, done - op.t0)
        if carried:
            with self._lock:
                self._ops[:0] = carried
        blocked = self._blocked
        unseen_s = 0.0
        clocks = self._clocks
        for tail in self._tails:
            interval = tail.interval(ops)
            if interval is not None:
                blocked.append(interval)
            if tail.end is not None and tail.cpu_end is not None:
                clocks.append((tail.end, tail.cpu_end))
            unseen_s += tail.unseen_s(ops)
        if self.infer_tail:
            blocked.extend(_inferred_tail(ops))
        if self._untimed or self.blind:
            self.steps_not_timed += 1
            return
        self.steps_measured += 1
        clocks.append((t_end, cpu_end))
        contended = contention_seconds(clocks, busy, blocked)
        # The unseen work happened after the step began and before the last measured moment:
        # that bounds both figures (the ledger's clock reads bracket the record's window by a
        # few µs, within the wire's slack).
        span_s = last_end(busy + blocked, t_begin, t_end) - t_begin
        exposed = min(span_s, union_seconds(blocked, t_begin, t_end) + unseen_s + contended)
        fields["comm"] = {
            "exposed": exposed,
            # Work done for communication on the training thread (a hook compressing, DDP
            # copying buckets back) is communication time too: busy covers what is exposed.
            "busy": min(span_s, max(exposed, union_seconds(busy + blocked, t_begin, t_end) + unseen_s)),
            "ops": {name: [count, size, seconds] for name, (count, size, seconds) in kinds.items()},
        }

    def _device_step_end(self, fields: dict[str, object], ops: list[Op], duration_s: float) -> None:
        """A step whose collectives ran on a GPU: its ``comm`` is read from their events."""
        clock = self.device_clock()
        host_ops = any(op.events is None for op in ops)
        if self._untimed or self.blind or host_ops or clock is None or not self._tails:
            # Mixed with host-timed collectives, or no wait to read the exposed time from.
            self.steps_not_timed += 1
            return
        self.steps_measured += 1
        fields["comm"] = DeviceComm(clock, ops, self._tails, duration_s)


def _inferred_tail(ops: Iterable[Op]) -> list[tuple[float, float]]:
    """The wait from the last launch on the training thread to the last completion."""
    launches = [op.t1 for op in ops if op.on_training_thread]
    completions = [op.t_done for op in ops if op.t_done is not None]
    if not launches or not completions:
        return []
    return [(max(launches), max(completions))]
