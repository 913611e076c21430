"""Collective communication measured on the host, per step: the ledger a watched model's
monitor keeps (``CommLedger``, the monitor's step extension) of the collectives and the training
thread's waits for them (``comm.ops``' ``Op`` and ``Tail``).

How and why it measures what it does (busy, exposed, contention; which step an operation
belongs to; what is not measured): docs/architecture.md §5.1. The same figures from CUDA events
on a GPU are ``comm.device``'s; the interval arithmetic both use is ``comm.intervals``'.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from time import perf_counter, thread_time
from typing import Any

from gpumon.client.comm.device import DeviceComm
from gpumon.client.comm.intervals import contention_seconds, last_end, union_seconds
from gpumon.client.comm.ops import Op, Tail
from gpumon.client.comm.tapped import RECEIVES

__all__ = ["MAX_PENDING_OPS", "CommLedger"]

MAX_PENDING_OPS = 4096
"""Operations kept in flight across step ends; beyond that the oldest are dropped and counted
(a collective that never completes, such as a peer that died, must not grow memory)."""


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
        self._receiving: list[tuple[float, float]] = []  # the part of _blocked spent receiving
        self._received = False  # a receive was launched in the step
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
        self._receiving = []
        self._received = False
        self._tails = []
        self._untimed = False
        self._device_timed = False

    def launched(self, name: str, nbytes: int, t0: float, t1: float, host_timed: bool,
                 cpu: tuple[float, float] | None = None, device_start: Any = None,
                 receiving: bool = False) -> Op | None:
        """Record a collective launched over [t0, t1] (``cpu``: the calling thread's CPU clock
        at both); None when outside a step. One on a GPU (not ``host_timed``) is timed by its
        events, ``device_start`` the one recorded at its launch (else it is not timed).
        ``receiving``: a blocking receive, whose call on the training thread is bubble."""
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
                if receiving:
                    self._receiving.append((t0, t1))
                if cpu is not None:
                    self._clocks += ((t0, cpu[0]), (t1, cpu[1]))
            if name in RECEIVES:
                self._received = True
            self._ops.append(op)
            if len(self._ops) > MAX_PENDING_OPS:
                del self._ops[0]
                self.dropped_ops += 1
        return op

    def blocked(self, t0: float, t1: float, cpu: tuple[float, float] | None = None,
                receiving: bool = False) -> None:
        """The training thread was held up by communication over [t0, t1] (``cpu``: its CPU
        clock at both); ``receiving``: waiting to receive from another rank."""
        if self._t_begin is not None:
            self._blocked.append((t0, t1))
            if receiving:
                self._receiving.append((t0, t1))
            if cpu is not None:
                self._clocks += ((t0, cpu[0]), (t1, cpu[1]))

    def wait_from(self, start: float, mirrored: bool = False,
                  receiving: bool = False) -> Tail | None:
        """The training thread waits from ``start`` until the step's collectives complete
        (see ``Tail`` for ``mirrored``); ``receiving``: for a receive (a GPU's wait on a
        transfer: its events time it)."""
        if self._t_begin is None:
            return None
        clock = self.device_clock() if self._device_timed or receiving else None
        tail = Tail(start, mirrored, clock, receiving)
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
            done = op.done_by(t_end)
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
        # that bounds both figures (the ledger's clock reads bracket the record's window
        # closely, within the wire's slack).
        span_s = last_end(busy + blocked, t_begin, t_end) - t_begin
        exposed = min(span_s, union_seconds(blocked, t_begin, t_end) + unseen_s + contended)
        comm: dict[str, object] = {
            "exposed": exposed,
            # Work done for communication on the training thread (a hook compressing, DDP
            # copying buckets back) is communication time too: busy covers what is exposed.
            "busy": min(span_s, max(exposed, union_seconds(busy + blocked, t_begin, t_end) + unseen_s)),
            "ops": {name: [count, size, seconds] for name, (count, size, seconds) in kinds.items()},
        }
        if self._received:  # a pipeline stage's wait for its neighbour, within what is exposed
            comm["bubble"] = min(exposed, union_seconds(self._receiving, t_begin, t_end))
        fields["comm"] = comm

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
