"""Time the training thread spends outside its steps on something known — a checkpoint saved or
restored, an evaluation pass — reported as ``span`` records (``gpumon.wire.SpanRecord``), and
the word that the process finished cleanly (the ``finished`` event): what the agent needs to
tell goodput from badput (docs/goodput.md).

A monitor holds one ``SpanReporter``; ``mon.checkpoint()``, ``mon.evaluation()`` and the
checkpoint taps (``watchers/checkpoints.py``) report through it. Reporting queues a record for
the sender's next flush: it never blocks and never raises.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter, time
from typing import TYPE_CHECKING

from gpumon.wire import MAX_LABEL_CHARS, SPAN_KINDS, EventRecord, SpanRecord, is_label

if TYPE_CHECKING:
    from gpumon.client.core.sender import Sender

FINISHED_EVENT = "finished"
"""The event a monitor sends when it closes with no exception escaping: its process's part of
the run is done, and the agent keeps every step it did."""


class SpanReporter:
    """Reports a monitor's spans to its sender; ``steps()`` is the monitor's count of the steps
    its process has completed (what a save covers)."""

    def __init__(self, sender: Sender, steps: Callable[[], int]) -> None:
        self._sender = sender
        self._steps = steps
        self.closed = False
        self.reported = 0

    def steps(self) -> int:
        """Steps the process has completed so far."""
        return self._steps()

    def report(self, kind: str, seconds: float, ok: bool | None, *, steps: int | None = None,
               api: str | None = None, nbytes: int | None = None, pending: bool = False) -> None:
        """Queue one span (``kind`` one of ``SPAN_KINDS``); ``steps`` defaults to the count now."""
        if self.closed or kind not in SPAN_KINDS:
            return
        hello = self._sender.hello
        if api is not None and not is_label(api, MAX_LABEL_CHARS):
            api = None
        self._sender.add_control(SpanRecord(
            hello.run, hello.rank, kind, max(0.0, seconds), ok,
            self._steps() if steps is None else steps, api,
            None if nbytes is None or nbytes < 0 else int(nbytes), pending, time(), hello.pid))
        self.reported += 1

    @contextmanager
    def timed(self, kind: str, api: str) -> Iterator[None]:
        """Time the block as one span of ``kind``; it failed if an exception escapes (which
        propagates unchanged)."""
        steps = self._steps()
        began = perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            self.report(kind, perf_counter() - began, ok, steps=steps, api=api)

    def finished(self) -> None:
        """The process's part of the run is done: say so, once."""
        if self.closed:
            return
        hello = self._sender.hello
        self._sender.add_control(EventRecord(hello.run, hello.rank, FINISHED_EVENT, time(),
                                             self._steps(), hello.pid, hello.gpu))


def exiting_cleanly() -> bool:
    """Whether the interpreter is not ending because an exception escaped the program (Python
    keeps the one it printed in ``sys.last_value``, ``sys.last_exc`` from 3.12)."""
    return getattr(sys, "last_exc", None) is None and getattr(sys, "last_value", None) is None


def on_training_thread() -> bool:
    """Whether the caller runs on the thread that trains (the process's main thread)."""
    return threading.current_thread() is threading.main_thread()
