"""The hook's watch on its own progress: whether the rank still steps, and where its training
thread is when it does not.

Run by the sender's thread at every wake-up (``Sender`` calls ``tick``), never by the training
thread: the training thread only keeps the core's readings it keeps anyway (``steps``, and
``open_phase``: one pointer store per phase). A rank is stalled when no step has ended for
longer than ``max(min_s, STALL_FACTOR × its typical step)``, the typical step being the median
interval between step ends over its last ``TYPICAL_WINDOW`` observations: a 5 s checkpoint
every 50 steps of 0.2 s is not a stall (20 s floor by default), a rank stepping every 5 s is
reported after 50 s, a job paused in a debugger for two minutes is reported (it is stalled).

A rank with no step for that long that still makes progress — whose count of progress events
(``progress``: collectives launched, module calls on the training thread, the model calls
``gpumon run``'s wrapper sees) moved within the threshold: an evaluation pass, forwards under
``no_grad`` — is ``evaluating``, not stalled; one whose count stood still for the threshold (a
forward that never returns, a wait in user code) is stalled. The module-call probe is armed
only once no step has ended for ``SAMPLE_FROM`` of the threshold, and takes itself out at its
first call, so a stepping rank pays nothing for it and an evaluating one one hook call per
wake-up.

While stalled, every ``REPORT_EVERY_S`` it reads the training thread's Python stack
(``sys._current_frames()``, only then), the open phase and the collective in flight
(``comm_inflight``) and sends them as a ``state`` record; otherwise a small ``stepping``
record every ``HEARTBEAT_S`` tells the agent the hook is alive, so that a process that
sends nothing at all (a thread holding the interpreter lock) can be told from one that waits.
The heartbeat carries the open phase and the innermost frame of the job's own code: where a
rank was last seen if it vanishes (killed, crashed) without closing its monitor.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import sysconfig
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Protocol

import gpumon
from gpumon.client.core.comm_inflight import IN_FLIGHT, InFlightCollectives
from gpumon.client.core.progress import PROGRESS
from gpumon.wire import (
    MAX_DATAGRAM_BYTES,
    MAX_FRAME_TEXT_CHARS,
    MAX_STACK_FRAMES,
    InFlight,
    StackFrame,
    StateRecord,
    encode_record,
)

log = logging.getLogger("gpumon.client")

STALL_AFTER_ENV = "GPUMON_STALL_AFTER_S"
STALL_AFTER_MIN_S = 20.0
"""The shortest wait for a step that counts as a stall (``$GPUMON_STALL_AFTER_S``): longer
than a checkpoint save or an evaluation pass of most jobs, short enough to page within a
minute of a hang."""
STALL_FACTOR = 10.0
"""A step interval this many times the rank's typical one is a stall (above the floor)."""
TYPICAL_WINDOW = 32
REPORT_EVERY_S = 2.0
"""While stalled, the place is read and sent this often."""
HEARTBEAT_S = 5.0
"""While stepping, the hook says it is alive this often (one ~250-byte datagram)."""
SAMPLE_FROM = 0.5
"""Share of the threshold: the module-call probe is armed once no step has ended for this
long, so that half a threshold of module calls is behind the decision when it is reached."""


class ProgressCount(Protocol):
    """What the watch reads of the process's progress events (``ProgressEvents``)."""

    def count(self) -> int: ...

    def arm(self, thread: int | None) -> None: ...

    def disarm(self) -> None: ...


class CoreReadings(Protocol):
    """What the watch reads of the hook's core (``HookCore``)."""

    @property
    def steps(self) -> int: ...

    @property
    def open_phase(self) -> str | None: ...


def stall_after_min_s() -> float:
    """The floor of the stall threshold: ``$GPUMON_STALL_AFTER_S`` when it is a positive
    number (else the default, with a warning)."""
    text = os.environ.get(STALL_AFTER_ENV)
    if not text:
        return STALL_AFTER_MIN_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 86_400:
        log.warning("gpumon: %s=%r is not a number of seconds; using %.0f", STALL_AFTER_ENV, text,
                    STALL_AFTER_MIN_S)
        return STALL_AFTER_MIN_S
    return value


class StallWatch:
    """Decides, at each ``tick``, whether the rank is stalled, and queues ``state`` records
    through ``send``."""

    def __init__(self, core: CoreReadings, run: str, rank: int, pid: int,
                 send: Callable[[StateRecord], None], min_s: float | None = None,
                 in_flight: InFlightCollectives = IN_FLIGHT,
                 progress: ProgressCount = PROGRESS) -> None:
        self._core = core
        self._run, self._rank, self._pid = run, rank, pid
        self._send = send
        self.min_s = stall_after_min_s() if min_s is None else min_s
        self._in_flight = in_flight
        self.training_thread: int | None = threading.get_ident()
        """The thread whose stack is read (the one that runs the steps)."""
        self._steps = 0
        self._progress_s: float | None = None  # monotonic time the step count last changed
        self._intervals: deque[float] = deque(maxlen=TYPICAL_WINDOW)
        self._last_sent_s: float | None = None
        self._state = "stepping"
        self._closed = False
        self._progress = progress
        self._events: int | None = None  # the progress count at the last tick
        self._active_s: float | None = None  # monotonic time the progress count last moved

    @property
    def stalled(self) -> bool:
        """Whether the last tick found the rank stalled."""
        return self._state == "stalled"

    @property
    def state(self) -> str:
        """What the last tick found: ``stepping``, ``evaluating`` or ``stalled``."""
        return self._state

    def threshold_s(self) -> float:
        """How long without a step ending counts as a stall now."""
        typical = statistics.median(self._intervals) if self._intervals else 0.0
        return max(self.min_s, STALL_FACTOR * typical)

    def tick(self, now_s: float, unix_s: float) -> None:
        """Look at the rank's progress at monotonic ``now_s`` (unix ``unix_s``)."""
        if self._closed:
            return
        steps = self._core.steps
        events = self._progress.count()
        if events != self._events:
            if self._events is not None:
                self._active_s = now_s
            self._events = events
        if steps != self._steps:
            if self._progress_s is not None and steps > self._steps:
                self._intervals.append((now_s - self._progress_s) / (steps - self._steps))
            self._steps, self._progress_s = steps, now_s
            self._active_s = None
            self._progress.disarm()
            if self._state != "stepping":  # steps again: say so now
                self._state = "stepping"
                self._emit("stepping", now_s, unix_s)
                return
        since_s = self._progress_s
        threshold = self.threshold_s()
        waited = None if since_s is None else now_s - since_s
        if waited is not None and waited > SAMPLE_FROM * threshold:
            self._progress.arm(self.training_thread)  # count the next module call
        state = "stepping"
        if waited is not None and waited > threshold:
            active = self._active_s
            recent = active is not None and now_s - active <= threshold
            state = "evaluating" if recent else "stalled"
        last = self._last_sent_s
        every = REPORT_EVERY_S if state == "stalled" else HEARTBEAT_S
        if state != self._state or last is None or now_s - last >= every:
            self._state = state
            self._emit(state, now_s, unix_s)

    def close(self, now_s: float, unix_s: float) -> None:
        """The monitor closed: say so once (the process may go on without steps)."""
        if not self._closed:
            self._progress.disarm()
            self._emit("closed", now_s, unix_s)
            self._closed = True

    def _emit(self, state: str, now_s: float, unix_s: float) -> None:
        self._last_sent_s = now_s
        since = None if self._progress_s is None else unix_s - (now_s - self._progress_s)
        record = StateRecord(self._run, self._rank, state, unix_s, self._steps, since=since,
                             threshold_s=self.threshold_s(), pid=self._pid,
                             launched=self._in_flight.launched or None)
        record = self._place(record) if state == "stalled" else self._last_seen(record)
        self._send(record)

    def _last_seen(self, record: StateRecord) -> StateRecord:
        """``record`` with the open phase and the innermost frame of the job's own code."""
        phase = getattr(self._core, "open_phase", None)
        frame = None if self.training_thread is None else sys._current_frames().get(self.training_thread)
        own = next((f for f in read_stack(frame) if f.own), None)
        return _with(record, phase, None, () if own is None else (own,))

    def _place(self, record: StateRecord) -> StateRecord:
        """``record`` with where the training thread is: phase, collective, stack."""
        phase = getattr(self._core, "open_phase", None)  # None from a core built before it
        op = self._in_flight.oldest()
        flight = None if op is None else InFlight(op.op, op.seq, op.nbytes, op.since_unix_s, op.on_device)
        frame = None if self.training_thread is None else sys._current_frames().get(self.training_thread)
        stack = read_stack(frame)
        fitted = _with(record, phase, flight, stack)
        while stack and len(encode_record(fitted)) > MAX_DATAGRAM_BYTES - 2:
            stack = stack[: len(stack) * 3 // 4]  # the innermost frames matter most
            fitted = _with(record, phase, flight, stack)
        return fitted


def _with(record: StateRecord, phase: str | None, flight: InFlight | None,
          stack: tuple[StackFrame, ...]) -> StateRecord:
    return StateRecord(record.run, record.rank, record.state, record.t, record.steps, record.since,
                       record.threshold_s, record.pid, phase, record.launched, flight, stack)


def read_stack(frame: FrameType | None) -> tuple[StackFrame, ...]:
    """A thread's frames from ``frame`` outwards (innermost first, at most
    ``MAX_STACK_FRAMES``), each marked as the job's own code or not."""
    frames: list[StackFrame] = []
    while frame is not None and len(frames) < MAX_STACK_FRAMES:
        code = frame.f_code
        filename = code.co_filename
        frames.append(StackFrame(_short_path(filename), max(0, frame.f_lineno or 0),
                                 _text(getattr(code, "co_qualname", code.co_name)),
                                 is_own_code(filename)))
        frame = frame.f_back
    return tuple(frames)


_LIBRARY_DIRS: tuple[str, ...] | None = None
_own_cache: dict[str, bool] = {}


def is_own_code(filename: str) -> bool:
    """Whether ``filename`` is the job's own code: not the interpreter's library, not an
    installed package, not gpumon, not a frozen or generated module."""
    known = _own_cache.get(filename)
    if known is not None:
        return known
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is None:
        paths = sysconfig.get_paths()
        dirs = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
        dirs.add(str(Path(gpumon.__file__).parent))
        _LIBRARY_DIRS = tuple(os.path.realpath(d) + os.sep for d in dirs)
    own = not filename.startswith("<") and not os.path.realpath(filename).startswith(_LIBRARY_DIRS)
    if len(_own_cache) < 4096:
        _own_cache[filename] = own
    return own


def _short_path(filename: str) -> str:
    """The file's last two path components, within the wire's limit."""
    parts = filename.replace(os.sep, "/").rsplit("/", 2)
    return _text("/".join(parts[-2:]), tail=True)


def _text(value: str, tail: bool = False) -> str:
    value = "".join(c if c.isprintable() else "?" for c in value) or "?"
    if len(value) <= MAX_FRAME_TEXT_CHARS:
        return value
    return value[-MAX_FRAME_TEXT_CHARS:] if tail else value[:MAX_FRAME_TEXT_CHARS]


def monotonic_and_unix() -> tuple[float, float]:
    """The two clocks the watch is ticked with (perf_counter, as the core's, and unix time)."""
    return time.perf_counter(), time.time()
