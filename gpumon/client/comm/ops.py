"""What a step's collective ledger records: each collective (``Op``), launched on one thread and
completed on another, and each wait of the training thread for them (``Tail``), with the CUDA
events that time both on a GPU (``record_event``). The host ledger (``comm``) and the device
reading (``comm.device``) both read them.
"""

from __future__ import annotations

from collections.abc import Iterable
from time import perf_counter, thread_time
from typing import Any

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
                 "events", "future")

    def __init__(self, name: str, nbytes: int, t0: float, t1: float, on_training_thread: bool) -> None:
        self.name = name
        self.nbytes = nbytes
        self.t0 = t0  # launch call entered
        self.t1 = t1  # launch call returned
        self.t_done: float | None = None
        self.counted_until = t0  # busy time before this was reported with an earlier step
        self.on_training_thread = on_training_thread
        self.events: list[Any] | None = None  # CUDA events at launch and completion, on a GPU
        self.future: Any = None
        """The work's future, until its callback (``done``) has run."""

    def done(self, _future: object = None) -> None:
        """Stamp the completion (called from the thread that completes the work)."""
        self.t_done = perf_counter()
        self.future = None

    def done_by(self, t: float) -> float | None:
        """The completion's time, or ``t`` where the work has completed and its callback has
        not run yet: a future wakes its waiters before it runs its callbacks, so the training
        thread can resume, and close its step, while the thread that completed the work is
        still on its way to ``done``."""
        if self.t_done is None:
            future = self.future
            if future is not None and future.done():
                self.t_done = t
        return self.t_done

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

    __slots__ = ("start", "end", "cpu_end", "mirrored", "clock", "events", "receiving")

    def __init__(self, start: float, mirrored: bool = False, clock: Any = None,
                 receiving: bool = False) -> None:
        self.start = start
        self.receiving = receiving  # a wait to receive from another rank: a stage's bubble
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
