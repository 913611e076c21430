"""A worker that polls devices in turn: a round per ask on a thread of its own, or a round on
the caller's thread (``PollerSet`` in ``pollers.py`` decides which, and moves devices between
workers). What each poll answered, and the device it is inside now and for how long, are what
the set reads to isolate a hung GPU and to report it down."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from gpumon.collectors.samples import GpuSample

log = logging.getLogger(__name__)


class Pollable(Protocol):
    """A device that can be polled for one sample (blocking, possibly for long)."""

    index: int

    def sample(self, now: float, monotonic: float) -> GpuSample | None: ...


def describe(device: Pollable) -> str:
    """How the logs name a pollable: a GPU by its index, else what it is."""
    return f"GPU {device.index}" if device.index >= 0 else type(device).__name__


class Worker:
    """Polls its devices in turn, one round per ask on a daemon thread of its own, or a round
    on the caller's thread (``run_round``: then it has no thread until ``start_thread``)."""

    def __init__(self, devices: list[Pollable], timeout_s: float, budget_s: float,
                 name: str, threaded: bool = True) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.budget_s = budget_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._devices = list(devices)
        self._asked: tuple[float, float] | None = None  # (now, monotonic) of the next round
        self._busy = False
        self._current: tuple[Pollable, float] | None = None  # device in a poll, since
        self._results: dict[int, GpuSample] = {}
        self._finished = threading.Event()
        self._finished.set()
        self._stopped = False
        self.in_budget_streak = 0
        """Polls in a row that answered within the budget (what an isolated GPU rejoins by)."""
        self.on_round: Callable[[dict[int, GpuSample]], None] | None = None
        """Where a round's samples go as it ends (on this thread); None: kept for ``take``."""
        self._thread: threading.Thread | None = None
        if threaded:
            self.start_thread()

    def start_thread(self) -> None:
        """Take asks on a thread of its own from now on."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
                self._thread.start()

    def end_thread(self) -> None:
        """No thread of its own from now on (its rounds run on the caller's thread)."""
        with self._lock:
            self._thread = None
            self._wake.notify()

    @property
    def devices(self) -> list[Pollable]:
        with self._lock:
            return list(self._devices)

    def ask(self, now: float, monotonic: float) -> bool:
        """Start a round on its thread unless one is running; whether one was started."""
        with self._lock:
            if self._busy or self._stopped or not self._devices or self._thread is None:
                return False
            self._asked = (now, monotonic)
            self._busy = True
            self._finished.clear()
            self._wake.notify()
            return True

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the running round; whether none is running now."""
        return self._finished.wait(max(timeout_s, 0.0))

    def take(self) -> dict[int, GpuSample]:
        """Samples of the polls finished since the last call, by GPU index."""
        with self._lock:
            results, self._results = self._results, {}
            return results

    def in_poll(self) -> tuple[Pollable, float] | None:
        """(the device now being polled, seconds so far), or None."""
        with self._lock:
            current = self._current
        return None if current is None else (current[0], time.monotonic() - current[1])

    def keep_only(self, device: Pollable) -> list[Pollable]:
        """Poll ``device`` alone from now on; returns the devices given up."""
        with self._lock:
            others = [d for d in self._devices if d is not device]
            self._devices = [device]
            self.in_budget_streak = 0
            return others

    def add(self, device: Pollable) -> None:
        """Poll one more device from the next round on."""
        with self._lock:
            self._devices.append(device)
            self._devices.sort(key=lambda d: d.index)

    def idle(self) -> bool:
        with self._lock:
            return not self._busy

    def run_round(self, now: float, monotonic: float,
                  started: Callable[[], None] | None = None) -> bool:
        """A round on the caller's thread unless one is running; whether it ran.
        ``started()`` is called once the round counts as running (``idle()`` is False)."""
        with self._lock:
            if self._busy or self._stopped or not self._devices:
                return False
            self._busy = True
            self._finished.clear()
        if started is not None:
            started()
        self._round(now, monotonic)
        return True

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                while self._asked is None and not self._stopped and self._thread is me:
                    self._wake.wait()
                if self._stopped or self._thread is not me:
                    return
                now, monotonic = self._asked or (0.0, 0.0)
                self._asked = None
            self._round(now, monotonic)

    def _round(self, now: float, monotonic: float) -> None:
        """Poll each device in turn, then hand the samples on (``on_round``). Busy is set."""
        with self._lock:
            devices = list(self._devices)
        for device in devices:
            with self._lock:
                if self._stopped:
                    break
                if device not in self._devices:  # given to another worker meanwhile
                    continue
                started = time.monotonic()
                self._current = (device, started)
            try:
                sample: GpuSample | None = device.sample(now, monotonic)
            except Exception:  # the device's own errors are its business; keep polling
                log.exception("polling %s failed", describe(device))
                sample = None
            took = time.monotonic() - started
            with self._lock:
                self._current = None
                self.in_budget_streak = self.in_budget_streak + 1 if took <= self.budget_s \
                    else 0
                if sample is not None and took <= self.timeout_s \
                        and device in self._devices:
                    self._results[device.index] = sample
        with self._lock:
            self._busy = False
            on_round = self.on_round
            results = None
            if on_round is not None and self._results:
                results, self._results = self._results, {}
        self._finished.set()
        if on_round is not None and results:
            try:
                on_round(results)
            except Exception:  # the receiver's errors are its business; keep polling
                log.exception("handing on the samples of GPUs %s failed", sorted(results))

    def stop(self, timeout_s: float) -> bool:
        """Stop polling; whether no round is left inside a poll (its own thread's, or one
        on another thread)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._stopped = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                return False
        return self._finished.wait(max(deadline - time.monotonic(), 0.0))
