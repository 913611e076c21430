"""A watchdog that costs nothing until it fires: a kernel timer armed around a call.

The pollers run the shared round of NVML polls on the agent's clock thread, so that a second
of the agent wakes one thread, not two. Something must still notice when a call inside that
round hangs. A thread that checked would wake every round; instead a Linux ``timerfd`` is
armed with the round's budget as the round starts and disarmed as it ends (two system calls,
no thread switch), and the watchdog's thread, blocked reading the timer, wakes only when a
round overran. ``Watchdog.create`` returns None where there is no ``timerfd`` (not Linux):
the pollers then keep a polling thread of their own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

CLOCK_MONOTONIC = 1
TFD_CLOEXEC = 0o2000000


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.timerfd_settime.argtypes = (ctypes.c_int, ctypes.c_int,
                                         ctypes.POINTER(_Itimerspec), ctypes.c_void_p)
    except (OSError, AttributeError):
        return None
    return libc


def _spec(seconds: float) -> _Itimerspec:
    spec = _Itimerspec()
    whole = int(seconds)
    spec.it_value.tv_sec = whole
    spec.it_value.tv_nsec = int((seconds - whole) * 1e9)
    if seconds > 0 and whole == 0 and spec.it_value.tv_nsec == 0:
        spec.it_value.tv_nsec = 1  # a zero value would disarm
    return spec


class Watchdog:
    """``on_expire()`` on the watchdog's own thread when an armed period ends before
    ``disarm``. One period at a time; ``arm`` again re-arms."""

    def __init__(self, libc: ctypes.CDLL, fd: int, period_s: float,
                 on_expire: Callable[[], None], name: str) -> None:
        self._settime = libc.timerfd_settime
        self._fd = fd
        self._specs = (_spec(period_s), _spec(0.0), _spec(1e-9))  # armed, disarmed, at once
        self._armed, self._disarmed, self._at_once = (ctypes.byref(s) for s in self._specs)
        self._on_expire = on_expire
        self._stopped = False
        self.period_s = period_s
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    @classmethod
    def create(cls, period_s: float, on_expire: Callable[[], None],
               name: str = "gpumon-watchdog") -> Watchdog | None:
        """A watchdog, or None where the kernel has no ``timerfd``."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC)
        if fd < 0:
            return None
        return cls(libc, fd, period_s, on_expire, name)

    def arm(self) -> None:
        """Fire after ``period_s`` unless disarmed first."""
        self._settime(self._fd, 0, self._armed, None)

    def disarm(self) -> None:
        self._settime(self._fd, 0, self._disarmed, None)

    def _run(self) -> None:
        while True:
            try:
                os.read(self._fd, 8)  # the expirations since the last read
            except OSError:
                return  # closed
            if self._stopped:
                os.close(self._fd)
                return
            try:
                self._on_expire()
            except Exception:  # the watchdog must outlive what it calls
                log.exception("the watchdog's handler failed")

    def stop(self) -> None:
        """End the thread (it closes the timer)."""
        self._stopped = True
        self._settime(self._fd, 0, self._at_once, None)
        self._thread.join(1.0)
