"""One polling thread per GPU, so that a device whose driver calls hang delays only itself.

Polled one after another, a GPU whose every call took 3 s left all eight GPUs' data ~9 s old
while the slow one still looked healthy. Here each device is polled on its own thread; a
collection cycle starts every idle device's poll, waits a bounded time for them, and takes
what has answered. A device still inside a poll after ``timeout_s`` is reported down with
``error="nvml_timeout"`` until a poll finishes in time again; what its late poll returns is
dropped (it describes a moment long past).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from gpumon.collectors.samples import GpuSample

log = logging.getLogger(__name__)

TIMEOUT_ERROR = "nvml_timeout"


class Pollable(Protocol):
    """A device that can be polled for one sample (blocking, possibly for long)."""

    index: int

    def sample(self, now: float, monotonic: float) -> GpuSample: ...


class DevicePoller:
    """Polls one device on a daemon thread of its own, one poll at a time."""

    def __init__(self, device: Pollable, timeout_s: float) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._asked: tuple[float, float] | None = None  # (now, monotonic) of the next poll
        self._busy_since: float | None = None  # time.monotonic() when the poll began
        self._result: GpuSample | None = None
        self._finished = threading.Event()
        self._stopped = False
        self.timed_out = False
        """Marked down for a poll that overran; cleared by the next poll on time."""
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"gpumon-nvml-gpu{device.index}")
        self._thread.start()

    def ask(self, now: float, monotonic: float) -> bool:
        """Start a poll unless one is running; whether one was started."""
        with self._lock:
            if self._busy_since is not None or self._stopped:
                return False
            self._asked = (now, monotonic)
            self._busy_since = time.monotonic()
            self._finished.clear()
            self._wake.notify()
            return True

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the running poll; whether none is running now."""
        return self._finished.wait(max(timeout_s, 0.0))

    def take(self) -> GpuSample | None:
        """The sample of the poll that finished since the last call, if any."""
        with self._lock:
            result, self._result = self._result, None
            return result

    def busy_for(self) -> float:
        """Seconds the running poll has taken so far (0 when idle)."""
        with self._lock:
            started = self._busy_since
        return 0.0 if started is None else time.monotonic() - started

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._asked is None and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                now, monotonic = self._asked or (0.0, 0.0)
                self._asked = None
                started = self._busy_since or time.monotonic()
            try:
                sample: GpuSample | None = self.device.sample(now, monotonic)
            except Exception:  # the device's own errors are its business; keep polling
                log.exception("polling GPU %d failed", self.device.index)
                sample = None
            late = time.monotonic() - started > self.timeout_s
            with self._lock:
                self._result = None if late else sample
                self._busy_since = None
            self._finished.set()

    def stop(self, timeout_s: float) -> bool:
        """Stop the thread; whether it has finished (False: stuck inside a poll)."""
        with self._lock:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class PollerSet:
    """The pollers of all devices, and one collection cycle over them."""

    def __init__(self, wait_s: float, timeout_s: float,
                 on_timeout: Callable[[int], None]) -> None:
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._pollers: dict[int, DevicePoller] = {}

    def add(self, device: Pollable) -> None:
        """Poll one more device from now on."""
        self._pollers[device.index] = DevicePoller(device, self.timeout_s)

    def sample(self, now: float, monotonic: float) -> list[GpuSample]:
        """Poll every idle device, wait up to ``wait_s`` for all, return what answered.

        A device with no fresh answer yet is left out of this cycle, or, past ``timeout_s``,
        comes back as down with ``error="nvml_timeout"``.
        """
        pollers = list(self._pollers.values())
        for poller in pollers:
            poller.ask(now, monotonic)
        deadline = time.monotonic() + self.wait_s
        for poller in pollers:
            poller.wait(deadline - time.monotonic())
        samples = []
        for poller in pollers:
            sample = poller.take()
            if sample is not None:
                if poller.timed_out:
                    log.warning("GPU %d answers NVML again", poller.device.index)
                poller.timed_out = False
                samples.append(sample)
            elif poller.timed_out or poller.busy_for() > self.timeout_s:
                if not poller.timed_out:
                    poller.timed_out = True
                    self._on_timeout(poller.device.index)
                samples.append(GpuSample(index=poller.device.index, t=now, up=False,
                                         error=TIMEOUT_ERROR))
        return sorted(samples, key=lambda s: s.index)

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Stop every poller; whether all finished (False: one is stuck in the driver)."""
        deadline = time.monotonic() + timeout_s
        return all([p.stop(max(deadline - time.monotonic(), 0.0))
                    for p in self._pollers.values()])
