"""Which training processes have ended: each pid the ingest socket's credentials named, checked
in ``/proc``.

A process is taken to have ended when its ``/proc/PID`` is gone, when it is a zombie (dead,
not yet reaped by its launcher), or when the pid now belongs to another process (its start
time differs from the one first seen: pids are reused). A pid the kernel gave as 0 (the
sender lives in a pid namespace the agent cannot see) never reaches here. ``alive`` asks the
same of one pid at once, when a second process claims a rank. ``ExitWatcher`` learns the
moment of each exit as it happens (a pidfd each), and ``started_monotonic`` when a process
began, for the time a rank's processes lived (``analysis.goodput``).
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

PROC = Path("/proc")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_stat(text: str) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from the text of ``/proc/PID/stat``, or None.

    The command name (field 2) is in parentheses and may hold spaces and parentheses itself:
    the fields after it are read from the last ``)``."""
    end = text.rfind(")")
    if end < 0:
        return None
    fields = text[end + 1:].split()
    # After the name: state is field 3, starttime field 22 (1-based), i.e. index 0 and 19 here.
    if len(fields) < 20:
        return None
    try:
        return fields[0], int(fields[19])
    except ValueError:
        return None


class ProcessLiveness:
    """Remembers each pid's start time at first sight and says which pids have ended since."""

    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc
        self._started: dict[int, int] = {}

    def alive(self, pid: int) -> bool:
        """Whether ``pid``'s process still runs (and is the one first seen under it, where it
        was): one read of its ``/proc/PID/stat``. Safe beside ``ended`` on another thread."""
        try:
            stat = parse_stat((self._proc / str(pid) / "stat").read_text())
        except OSError:
            return False
        if stat is None:
            return False
        state, started = stat
        return state not in ("Z", "X") and started == self._started.get(pid, started)

    def ended(self, pids: set[int]) -> set[int]:
        """The pids among ``pids`` whose process has ended (forgetting pids no longer asked about)."""
        gone = set()
        for pid in pids:
            try:
                stat = parse_stat((self._proc / str(pid) / "stat").read_text())
            except OSError:  # no such process (or no longer readable: it went away)
                stat = None
            if stat is None:
                gone.add(pid)
                continue
            state, started = stat
            first = self._started.setdefault(pid, started)
            if state in ("Z", "X") or started != first:
                gone.add(pid)
        for pid in list(self._started):
            if pid not in pids or pid in gone:
                del self._started[pid]
        return gone


def started_monotonic(pid: int, proc: Path = PROC) -> float | None:
    """When process ``pid`` started, on this process's monotonic clock (``time.monotonic``),
    from the kernel's start time in ``/proc/PID/stat`` (clock ticks since boot); None when
    the process cannot be read."""
    try:
        stat = parse_stat((proc / str(pid) / "stat").read_text())
    except OSError:
        return None
    if stat is None:
        return None
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - stat[1] / _CLOCK_TICKS
    return time.monotonic() - max(0.0, age)


class ExitWatcher:
    """The moment each watched process exits, from a pidfd per process (``pidfd_open``), polled
    on one thread: a restart, however fast, finds its predecessor's exit time known, and
    ``take()`` hands the exits over to the housekeeping. Where the kernel (or a sandbox) has
    no pidfds, ``available`` is false and the caller keeps to ``ProcessLiveness``'s checks.

    At most ``max_pids`` processes are watched at once (one descriptor each); a pid past that
    is left to the periodic check."""

    def __init__(self, max_pids: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._max_pids = max_pids
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # fd -> pid
        self._watched: set[int] = set()
        self._exits: dict[int, float] = {}
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poll.register(self._wake_r, select.POLLIN)
        self._closed = False
        self.available = hasattr(os, "pidfd_open") and _pidfds_work()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the polling thread (a daemon)."""
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpumon-exits", daemon=True)
            self._thread.start()

    def watch(self, pid: int) -> bool:
        """Watch ``pid`` from now on; whether it is new here (a process already gone is an
        exit now)."""
        if not self.available:  # the periodic check alone tells exits here
            return False
        with self._lock:
            if pid in self._watched or self._closed or len(self._fds) >= self._max_pids:
                return False
            self._watched.add(pid)
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._exits[pid] = self._clock()
                return True
            except OSError:
                self._watched.discard(pid)
                return False
            self._fds[fd] = pid
            self._poll.register(fd, select.POLLIN)
        os.write(self._wake_w, b"w")
        return True

    def take(self) -> dict[int, float]:
        """pid -> when it exited (monotonic), of the exits since the last call."""
        with self._lock:
            exits, self._exits = self._exits, {}
            self._watched.difference_update(exits)
            return exits

    def close(self) -> None:
        """Stop watching; every descriptor is closed. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        with self._lock:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        while True:
            events = self._poll.poll()
            now = self._clock()
            with self._lock:
                if self._closed:
                    return
                for fd, _ in events:
                    if fd == self._wake_r:
                        while _drain(fd):
                            pass
                        continue
                    pid = self._fds.pop(fd, None)
                    if pid is None:
                        continue
                    self._poll.unregister(fd)
                    os.close(fd)
                    self._exits[pid] = now


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _pidfds_work() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True
