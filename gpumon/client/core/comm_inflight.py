"""The collectives this process has launched and not seen complete, numbered in launch order.

When a run hangs, every rank but the one at fault sits in a collective; which one, and its
number, is what tells who waits on whom (the agent compares the numbers of a run's ranks:
``gpumon.analysis.stall``). The collective tap (``comm.tap``) reports each call here before
it is made (a blocking call that never returns is still seen) and when it completes: on
return when blocking, by its ``Work``'s future when asynchronous. On a GPU the future
completes once the work is queued; an event recorded in its callback (on streams made to wait
for the work) passes only when the collective's kernels have, so such an operation stays in
flight, ``on_device``, until the GPU passes that event.

Cheap by construction: a launch costs a counter and a dict insertion, a completion a removal;
only ``oldest()`` (read by the stall watch while a rank is stalled) looks at events.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_OPEN_OPS = 256
"""Operations kept while in flight; beyond, the oldest are forgotten (their completion was
lost, say a future that never ran its callbacks)."""


@dataclass(frozen=True, slots=True)
class OpenCollective:
    """A collective launched and not seen complete."""

    op: str
    seq: int
    nbytes: int
    since_unix_s: float
    on_device: bool


class InFlightCollectives:
    """The process's open collectives; safe to call from any thread (each call is one
    operation on a dict, which the interpreter makes atomic)."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self._launched = 0
        self._open: dict[int, list[Any]] = {}  # seq -> [op, bytes, unix launch time, event]

    @property
    def launched(self) -> int:
        """Collectives launched so far (the last sequence number given)."""
        return self._launched

    def begin(self, op: str, nbytes: int) -> int:
        """A collective is about to be launched; returns its sequence number."""
        seq = next(self._counter)
        self._launched = seq
        self._open[seq] = [op, nbytes, time.time(), None]
        if len(self._open) > MAX_OPEN_OPS:
            self._open.pop(next(iter(self._open)), None)
        return seq

    def end(self, seq: int, _future: object = None) -> None:
        """The collective ``seq`` completed (or failed)."""
        self._open.pop(seq, None)

    def queued_on_device(self, seq: int, event: Any) -> None:
        """The host side of ``seq`` completed; the GPU has finished it once ``event`` passed."""
        entry = self._open.get(seq)
        if entry is not None:
            entry[3] = event

    def completed(self, seq: int, on_device: bool) -> None:
        """``seq``'s future completed: on the host, the collective did; on a GPU, an event
        recorded now (in the future's callback, on streams made to wait for the work)
        passes when its kernels have."""
        if not on_device:
            self._open.pop(seq, None)
            return
        try:
            import torch

            event = torch.cuda.Event()
            event.record()
        except Exception:  # no event to follow it by: counted complete
            self._open.pop(seq, None)
            return
        self.queued_on_device(seq, event)

    def oldest(self) -> OpenCollective | None:
        """The earliest collective still in flight (forgetting those whose GPU event passed)."""
        for seq in sorted(self._open):
            entry = self._open.get(seq)
            if entry is None:
                continue
            event = entry[3]
            if event is not None:
                try:
                    passed = bool(event.query())
                except Exception:  # a broken context: its completion cannot be told
                    passed = False
                if passed:
                    self._open.pop(seq, None)
                    continue
            return OpenCollective(entry[0], seq, entry[1], entry[2], event is not None)
        return None


IN_FLIGHT = InFlightCollectives()
"""This process's open collectives (one per process, as the tap is)."""


STEP_OPENERS: list[Callable[[], Callable[[], None] | None]] = []
"""Called by the communication tap before a point-to-point transfer or its wait on the
training thread: one that opens a step (``gpumon run``'s step finder, when none is open)
returns what closes the phase it opened, once the call returns. A pipeline stage waits for
its first micro-batch before its first forward: without it, that wait would fall between
steps."""


def open_step_for_transfer() -> Callable[[], None] | None:
    """Ask the step openers for a step around a transfer; what to call after it, or None."""
    for opener in STEP_OPENERS:
        try:
            close = opener()
        except Exception:  # an opener must never break the transfer
            continue
        if close is not None:
            return close
    return None
