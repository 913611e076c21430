"""Collective communication measured from inside the training process, per step.

Under DDP, FSDP and ZeRO the collectives run inside backward, overlapped with it, so no
hand-timed phase can hold them. Two measurements make up a step's ``comm`` field:

- **busy**: when each collective was in flight. ``torch.distributed``'s collective functions
  (the calls DDP comm hooks, FSDP and user code make) are wrapped once per process
  (``comm_tap``); a call
  stamps its launch, and its completion is stamped when it returns (a blocking call) or by a
  callback on its ``Work``'s future (``async_op=True``; the callback runs before anything
  waiting on the work's chained futures is woken, so the stamp is the completion, not the
  waiter's wake-up). The union of these intervals within the step is ``busy``; per kind
  of collective: count, payload bytes (the buffer size nccl-tests calls "size": the tensor for
  all-reduce and broadcast, the whole gathered output for all-gather, the whole input for
  reduce-scatter and all-to-all) and summed seconds. ``busy`` also covers the exposed time
  below, so ``busy - exposed`` is what overlapped the step's other work.
- **exposed**: how long the training thread was held up by them: blocking calls, the launch
  of asynchronous ones, and waits the watcher of a wrapper can see (``ddp.py``: DDP's wait for
  its gradient buckets at the end of backward). The union of these intervals within the step,
  plus the **contention** below.
- **contention**: collectives on the host (gloo's threads reducing and sending the buckets)
  take CPUs the training thread's own work then waits for. While they are in flight and it is
  not blocked on them, the training thread's time off a CPU (wall clock less its CPU time), beyond
  the rate it spent off a CPU in the same step while none was in flight, lengthened the step as
  a wait on them would have. It is read from the thread's CPU clock at the edges of its waits
  and launches, and counted for host-timed collectives only (a GPU's collectives use no CPU).

An operation belongs to the step it is launched in; one still in flight when its step ends
adds its remaining time to the next step's ``busy`` and is counted (count, bytes, seconds)
there, so nothing is counted twice. Collectives launched outside any step (evaluation,
checkpointing, the trainer's barriers) are not counted.

**On a GPU** (NCCL) a collective call returns once its work is queued and the training thread
never waits for it: the host clock sees neither. There both figures come from CUDA events
(``DeviceComm``), where the watcher records them: an event on the launching stream as each
collective is launched and one on the stream its completion callback runs on (which the
collective's end gates), and around DDP's finalize, one as backward's last kernel is queued
and one after the stream was made to wait for every bucket and copy them back. The GPU time
between those two is the exposed communication: how long the stream's work stood still for
the collectives. The step's record is sent once the GPU has passed its events (the sender
waits for them as for the phases' events). Collectives on a GPU with no such events (a
function called outside DDP's hook, FSDP on CUDA), or a step that mixes them with host-timed
ones, give the step no ``comm`` field (not measured) rather than a wrong one.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from time import perf_counter, thread_time
from typing import Any

MAX_PENDING_OPS = 4096
"""Operations kept in flight across step ends; beyond that the oldest are dropped and counted
(a collective that never completes, such as a peer that died, must not grow memory)."""

NO_EVENT = object()
"""Stands for a CUDA event that could not be recorded: the step's ``DeviceComm`` is then
ready at once and has no value (its ``comm`` field is left out and counted)."""


def record_event(clock: Any) -> Any:
    """A CUDA event recorded now on the current stream, or ``NO_EVENT``: recording runs inside
    DDP's hook, its futures' callbacks and autograd's callbacks, where an error would fail the
    training step."""
    try:
        return clock.event()
    except Exception:
        return NO_EVENT


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
        span_s = _last_end(busy + blocked, t_begin, t_end) - t_begin
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


class DeviceComm:
    """A step's ``comm`` from CUDA events (the module docstring: on a GPU); a ``Deferred``
    the sender resolves once the GPU has passed every event."""

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
        return {
            "exposed": exposed,
            "busy": min(duration, max(exposed, union_seconds(busy + waits, lo, hi) + unseen_s)),
            "ops": {name: [count, size, seconds] for name, (count, size, seconds) in kinds.items()},
        }


def contention_seconds(clocks: list[tuple[float, float]], busy: list[tuple[float, float]],
                       blocked: list[tuple[float, float]]) -> float:
    """Seconds the training thread spent off a CPU, while not blocked, because collectives
    were in flight (``CommLedger``'s docstring: contention).

    ``clocks`` are (wall, CPU clock) readings of the training thread; between two consecutive
    ones it either waited on communication (the span touches ``blocked``: left out, the wait
    is counted already) or worked. A working span's time off a CPU is split by the share of
    it some collective was in flight (``busy``); the rest sets the off-CPU rate the step had
    without them, which is subtracted."""
    quiet_wall = quiet_off = 0.0
    spans: list[tuple[float, float, float]] = []  # (wall, off a CPU, share in flight)
    readings = sorted(clocks)
    for (wa, ca), (wb, cb) in itertools.pairwise(readings):
        wall = wb - wa
        if wall <= 0.0 or union_seconds(blocked, wa, wb) > 0.0:
            continue
        off = max(0.0, wall - (cb - ca))
        in_flight = union_seconds(busy, wa, wb) / wall
        spans.append((wall, off, in_flight))
        quiet_wall += wall * (1.0 - in_flight)
        quiet_off += off * (1.0 - in_flight)
    rate = quiet_off / quiet_wall if quiet_wall > 0.0 else 0.0
    return max(0.0, sum((off - rate * wall) * in_flight for wall, off, in_flight in spans))


def _inferred_tail(ops: Iterable[Op]) -> list[tuple[float, float]]:
    """The wait from the last launch on the training thread to the last completion."""
    launches = [op.t1 for op in ops if op.on_training_thread]
    completions = [op.t_done for op in ops if op.t_done is not None]
    if not launches or not completions:
        return []
    return [(max(launches), max(completions))]


def _last_end(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
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
