"""The training thread's wait for a CPU in each step: the step record's ``cpu_wait``.

On a host with more runnable threads than cores (a rank's loader workers, intra-op threads,
another job's processes, gloo's communication threads) the training thread is sometimes
ready to run and not running. That time lengthens the rank's step as if the rank had more
work, and makes its peers wait for it in the collectives; the straggler comparison has to
tell it from work. Linux counts it per thread: the second figure of
``/proc/thread-self/schedstat`` is the thread's *run delay*, nanoseconds spent runnable on a
run queue. Reading it is one ``pread`` of a file kept open, a few microseconds, at each
step's start and end.

Where the file cannot be read (not Linux, a kernel built without scheduler statistics, a
sandbox hiding ``/proc``) the field is left out: not measured. A step that ends on another
thread than it began on, or in a forked child, gets none either: the two readings would be of
different threads.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("gpumon.client")

SCHEDSTAT = "/proc/thread-self/schedstat"
"""Run time, run delay (both ns) and time slices of the calling thread."""


class CpuWaitClock:
    """The monitor's step extension that sets ``fields["cpu_wait"]`` (seconds)."""

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self._path = path
        self._fd: int | None = None
        self._owner: tuple[int, int] | None = None  # (pid, thread) the open file describes
        self._begin: tuple[tuple[int, int], int] | None = None
        self.unavailable = False
        """The file could not be read: no step carries the field."""

    def step_begin(self) -> None:
        reading = self._read()
        self._begin = None if reading is None or self._owner is None else (self._owner, reading)

    def step_end(self, fields: dict[str, object]) -> None:
        begin, self._begin = self._begin, None
        if begin is None:
            return
        reading = self._read()
        if reading is None or self._owner != begin[0]:
            return
        fields["cpu_wait"] = max(0, reading - begin[1]) / 1e9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = self._owner = None

    def _read(self) -> int | None:
        """The calling thread's run delay in ns, or None."""
        if self.unavailable:
            return None
        owner = (os.getpid(), threading.get_ident())
        try:
            if owner != self._owner:
                self.close()
                self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
                self._owner = owner
            assert self._fd is not None
            return int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError) as exc:
            self.unavailable = True
            self.close()
            log.info("gpumon: the training thread's wait for a CPU is not measured (%s: %s)",
                     self._path, exc)
            return None
