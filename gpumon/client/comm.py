"""Collective communication measured from inside the training process, per step.

Under DDP, FSDP and ZeRO the collectives run inside backward, overlapped with it, so no
hand-timed phase can hold them. Two measurements make up a step's ``comm`` field:

- **busy**: when each collective was in flight. ``torch.distributed``'s collective functions
  (the calls DDP comm hooks, FSDP and user code make) are wrapped once per process; a call
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
checkpointing, the trainer's barriers) are not counted. Collectives on a device whose work
the host clock does not see (CUDA: the call returns once the work is queued) are not timed
that way: a step with one carries no ``comm`` field (not measured) rather than a wrong one.

The wrapped functions cost a check of one list when no monitor is watching.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from time import perf_counter, thread_time
from typing import Any

log = logging.getLogger("gpumon.client")

MAX_PENDING_OPS = 4096
"""Operations kept in flight across step ends; beyond that the oldest are dropped and counted
(a collective that never completes, such as a peer that died, must not grow memory)."""

COLLECTIVES: dict[str, tuple[str, int, str]] = {
    # function name: (wire name, position of the payload argument, its keyword); -1: none
    "all_reduce": ("all_reduce", 0, "tensor"),
    "all_reduce_coalesced": ("all_reduce", 0, "tensors"),
    "broadcast": ("broadcast", 0, "tensor"),
    "reduce": ("reduce", 0, "tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "_all_gather_base": ("all_gather", 0, "output_tensor"),
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "_reduce_scatter_base": ("reduce_scatter", 1, "input"),
    "all_to_all": ("all_to_all", 1, "input_tensor_list"),
    "all_to_all_single": ("all_to_all", 1, "input"),
    "gather": ("gather", 0, "tensor"),
    "scatter": ("scatter", 0, "tensor"),
    "barrier": ("barrier", -1, ""),
}
"""The ``torch.distributed`` functions measured, and how each names its payload."""


class Op:
    """One collective: launched on some thread, completed (``t_done``) on another."""

    __slots__ = ("name", "nbytes", "t0", "t1", "t_done", "counted_until", "on_training_thread")

    def __init__(self, name: str, nbytes: int, t0: float, t1: float, on_training_thread: bool) -> None:
        self.name = name
        self.nbytes = nbytes
        self.t0 = t0  # launch call entered
        self.t1 = t1  # launch call returned
        self.t_done: float | None = None
        self.counted_until = t0  # busy time before this was reported with an earlier step
        self.on_training_thread = on_training_thread

    def done(self, _future: object = None) -> None:
        """Stamp the completion (called from the thread that completes the work)."""
        self.t_done = perf_counter()


class Tail:
    """A wait of the training thread from ``start`` until its step's operations completed,
    or until ``end``, stamped by a callback that ran when the waiter resumed.

    With ``mirrored``, the work between the last completion and ``end`` (DDP copying each
    bucket back into the gradients) was done once before too, unseen (DDP copying each
    gradient into its bucket as it became ready, inside backward): the same bytes, so it is
    taken to have cost the same, and counted as exposed once more. Where no copy is made
    (``gradient_as_bucket_view=True``) both are nil.
    """

    __slots__ = ("start", "end", "cpu_end", "mirrored")

    def __init__(self, start: float, mirrored: bool = False) -> None:
        self.start = start
        self.end: float | None = None
        self.cpu_end: float | None = None  # the waiter's CPU clock at ``end``
        self.mirrored = mirrored

    def resumed(self) -> None:
        """Stamp ``end``; called on the waiting thread."""
        self.end = perf_counter()
        self.cpu_end = thread_time()

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

    def __init__(self) -> None:
        self._lock = threading.Lock()  # launches from several threads (a hook's chained collective)
        self._ops: list[Op] = []
        self._blocked: list[tuple[float, float]] = []
        self._tails: list[Tail] = []
        self._clocks: list[tuple[float, float]] = []  # (wall, thread CPU) of the training thread
        self._t_begin: float | None = None
        self._thread: int | None = None
        self._untimed = False
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

    def launched(self, name: str, nbytes: int, t0: float, t1: float, host_timed: bool,
                 cpu: tuple[float, float] | None = None) -> Op | None:
        """Record a collective launched over [t0, t1] (``cpu``: the calling thread's CPU clock
        at both); None when outside a step."""
        if self._t_begin is None:
            self.outside_steps += 1
            return None
        on_training_thread = threading.get_ident() == self._thread
        op = Op(name, nbytes, t0, t1, on_training_thread)
        with self._lock:
            if not host_timed:
                self._untimed = True
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
        tail = Tail(start, mirrored)
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


# --- the wrapped torch.distributed functions ---------------------------------------------

_ledgers: list[CommLedger] = []
"""The ledgers the wrapped functions report to (one per watching monitor, usually one)."""
_installed = False
_install_lock = threading.Lock()


def tap_into(ledger: CommLedger) -> bool:
    """Report this process's ``torch.distributed`` collectives to ``ledger``; False if the
    functions could not be wrapped (no ``torch.distributed``)."""
    if not install_tap():
        return False
    if ledger not in _ledgers:
        _ledgers.append(ledger)
    return True


def untap(ledger: CommLedger) -> None:
    """Stop reporting to ``ledger`` (the wrappers stay, passing straight through)."""
    if ledger in _ledgers:
        _ledgers.remove(ledger)


def install_tap() -> bool:
    """Wrap the collective functions of ``torch.distributed`` once per process."""
    global _installed
    with _install_lock:
        if _installed:
            return True
        try:
            import torch.distributed as dist
            from torch.distributed import distributed_c10d
        except ImportError:
            return False
        if not dist.is_available():
            return False
        for fn_name, (wire_name, position, keyword) in COLLECTIVES.items():
            original = getattr(distributed_c10d, fn_name, None)
            if original is None or getattr(original, "__gpumon_wrapped__", False):
                continue  # not in this torch version: not measured
            wrapped = _wrap(original, wire_name, position, keyword)
            setattr(distributed_c10d, fn_name, wrapped)
            if getattr(dist, fn_name, None) is original:
                setattr(dist, fn_name, wrapped)
        _installed = True
        return True


def _wrap(original: Callable[..., Any], name: str, position: int, keyword: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if not _ledgers:
            return original(*args, **kwargs)
        c0, t0 = thread_time(), perf_counter()
        result = original(*args, **kwargs)
        t1, c1 = perf_counter(), thread_time()
        try:
            _record(name, _payload(args, kwargs, position, keyword), t0, t1, result, (c0, c1))
        except Exception:  # measuring must never break the collective
            log.debug("gpumon: could not record a %s", name, exc_info=True)
        return result

    collective.__gpumon_wrapped__ = True  # type: ignore[attr-defined]
    return collective


def _payload(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, keyword: str) -> Any:
    if position < 0:
        return None
    if keyword in kwargs:
        return kwargs[keyword]
    return args[position] if len(args) > position else None


def _record(name: str, payload: Any, t0: float, t1: float, result: Any,
            cpu: tuple[float, float] | None = None) -> None:
    tensors = payload if isinstance(payload, (list, tuple)) else [] if payload is None else [payload]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    host_timed = all(t.device.type == "cpu" for t in tensors)
    for ledger in _ledgers:
        op = ledger.launched(name, nbytes, t0, t1, host_timed, cpu)
        if op is None:
            continue
        get_future = getattr(result, "get_future", None)
        if get_future is None:  # returned after completing (or not part of the group)
            op.t_done = t1
            continue
        try:
            get_future().add_done_callback(op.done)
        except RuntimeError:  # this backend gives no future for this op: completion unknown
            op.t_done = t1
