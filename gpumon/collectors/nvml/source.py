"""All GPUs of the node through NVML: discovery, polling, XID events."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

import pynvml

from gpumon.collectors.nvml.device import NvmlDevice
from gpumon.collectors.nvml.library import error_name, init, shutdown, text
from gpumon.collectors.pollers import PollerSet
from gpumon.collectors.samples import GpuSample, GpuStatic

log = logging.getLogger("gpumon.collectors.nvml")


class XidWatcher(threading.Thread):
    """Waits for XID critical-error events on its own thread and reports (gpu, xid)."""

    def __init__(self, devices: list[NvmlDevice], on_xid: Callable[[int, int], None],
                 on_error: Callable[[str, str], None], timeout_ms: int = 1000) -> None:
        super().__init__(name="gpumon-xid", daemon=True)
        self._on_xid = on_xid
        self._on_error = on_error
        self._timeout_ms = timeout_ms
        self._stop_event = threading.Event()
        self._event_set: Any = None
        self._index_by_uuid: dict[str, int] = {}
        self.registered: list[int] = []
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            on_error("xid", error_name(exc))
            return
        for device in devices:
            self.register(device)

    def register(self, device: NvmlDevice) -> None:
        """Watch one more GPU (also one that appeared after start)."""
        if self._event_set is None:
            return
        try:
            pynvml.nvmlDeviceRegisterEvents(device._handle, pynvml.nvmlEventTypeXidCriticalError,
                                            self._event_set)
        except pynvml.NVMLError as exc:
            if exc.value != pynvml.NVML_ERROR_NOT_SUPPORTED:
                self._on_error("xid", error_name(exc))
            return
        self._index_by_uuid[device.static.uuid] = device.index
        self.registered.append(device.index)

    def run(self) -> None:
        if self._event_set is None:
            return
        wait = self._prepared_wait()
        while not self._stop_event.is_set():
            if not self.registered:  # nothing to wait on yet: a GPU may still appear
                self._stop_event.wait(self._timeout_ms / 1000.0)
                continue
            try:
                data = wait()
            except pynvml.NVMLError as exc:
                self._on_error("xid", error_name(exc))
                # Do not spin on a persistent error.
                self._stop_event.wait(self._timeout_ms / 1000.0)
                continue
            if data is None:  # the wait's timeout, every second of a healthy node
                continue
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                try:
                    uuid = text(pynvml.nvmlDeviceGetUUID(data.device))
                except pynvml.NVMLError:
                    uuid = ""
                index = self._index_by_uuid.get(uuid, -1)
                self._on_xid(index, int(data.eventData))

    def _prepared_wait(self) -> Callable[[], Any]:
        """One wait for an event: the event's data, None at the timeout, an ``NVMLError``
        otherwise. Its entry point and arguments are made once, and the timeout is a return
        code, not an exception raised and caught each second (the binding's)."""
        try:
            fn = pynvml._nvmlGetFunctionPointer("nvmlEventSetWait_v2")
        except pynvml.NVMLError as exc:  # counted as the wait's error, as any other
            missing = exc

            def fail() -> Any:
                raise missing

            return fail
        data = pynvml.c_nvmlEventData_t()
        args = (self._event_set, ctypes.byref(data), ctypes.c_uint(self._timeout_ms))
        timeout, success = pynvml.NVML_ERROR_TIMEOUT, pynvml.NVML_SUCCESS

        def wait() -> Any:
            ret = fn(*args)
            if ret == success:
                return data
            if ret == timeout:
                return None
            raise pynvml.NVMLError(ret)

        return wait

    def stop(self) -> None:
        """Ask the thread to finish after its current wait (at most one timeout)."""
        self._stop_event.set()

    def close(self) -> None:
        """Free the event set once the thread has finished."""
        if self._event_set is not None and not self.is_alive():
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError:
                pass
            self._event_set = None


class NvmlSource:
    """All GPUs of the node through NVML: discovery, polling and XID events.

    Every index NVML counts is exported: a GPU that cannot be opened (lost to the bus before
    the agent started, say after an Xid 79) is a down GPU with the labels that can be known,
    and opening it is tried again at every discovery. One thread polls every GPU
    (``PollerSet``); one whose calls overrun is moved to a thread of its own, and marked
    down once they hang, without delaying the others.
    """

    name = "nvml"

    def __init__(self, on_error: Callable[[str, str], None], interval_s: float = 1.0) -> None:
        self._on_error = on_error
        self.driver_version, self.nvml_version = init()
        self.devices: list[NvmlDevice] = []
        self.unopened: dict[int, str] = {}
        """Index -> why NVML would not open it (an NVML error name)."""
        self._pollers = PollerSet(wait_s=0.5 * interval_s,
                                  timeout_s=max(2.0 * interval_s, 2.0),
                                  on_timeout=self._timed_out)
        self._watcher: XidWatcher | None = None
        self._discovering = threading.Lock()  # held while NVML is asked for GPUs
        self.discover()

    def discover(self) -> list[GpuStatic]:
        """Open GPUs not open yet (at start, appearing later, or back after failing to
        open); returns the newly opened ones."""
        with self._discovering:
            return self._discover()

    def _discover(self) -> list[GpuStatic]:
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self._on_error("nvml", error_name(exc))
            return []
        known = {d.index for d in self.devices}
        new: list[GpuStatic] = []
        for index in range(count):
            if index in known:
                continue
            try:
                device = NvmlDevice(index, self._on_error)
            except pynvml.NVMLError as exc:
                if index not in self.unopened:  # say it once, keep trying quietly
                    log.error("GPU %d cannot be opened: %s; exporting it as down", index, exc)
                    self._on_error("nvml", error_name(exc))
                self.unopened[index] = error_name(exc)
                continue
            if self.unopened.pop(index, None) is not None:
                log.warning("GPU %d (%s) could be opened at last", index, device.static.uuid)
            self.devices.append(device)
            self._pollers.add(device)
            new.append(device.static)
            if self._watcher is not None:
                self._watcher.register(device)
        return new

    def statics(self) -> list[GpuStatic]:
        """Static facts of every GPU NVML counts (only the index of one not opened)."""
        placeholders = [GpuStatic(index=i, uuid="", name="", pci_bus_id="")
                        for i in self.unopened]
        return sorted([d.static for d in self.devices] + placeholders, key=lambda g: g.index)

    def sample(self, now: float, monotonic: float) -> list[GpuSample]:
        """Poll every GPU; a lost, unopened or hanging GPU comes back as ``up=False``, and
        one still polling (not yet past its timeout) is left out of this cycle."""
        samples = self._pollers.sample(now, monotonic)
        samples += [GpuSample(index=i, t=now, up=False, error=error)
                    for i, error in self.unopened.items()]
        return sorted(samples, key=lambda s: s.index)

    def poll(self, now: float, monotonic: float,
             deliver: Callable[[list[GpuSample]], None]) -> None:
        """The agent's cycle (``PollerSet.cycle``): returns at once; the workers deliver each
        round's samples as it ends, on their threads. A hanging GPU and an unopened one are
        delivered as down on this thread."""
        self._pollers.cycle(now, monotonic, deliver)
        unopened = dict(self.unopened)  # a look for new GPUs may be changing it
        if unopened:
            deliver([GpuSample(index=i, t=now, up=False, error=error)
                     for i, error in sorted(unopened.items())])

    def _timed_out(self, index: int) -> None:
        log.error("GPU %d: NVML calls take over %.0f s; marking it down until it answers in "
                  "time", index, self._pollers.timeout_s)
        self._on_error("nvml", "timeout")

    def xid_watcher(self, on_xid: Callable[[int, int], None]) -> XidWatcher:
        """A (not yet started) thread delivering XID events, also for GPUs found later."""
        self._watcher = XidWatcher(self.devices, on_xid, self._on_error)
        return self._watcher

    def close(self) -> None:
        """Free per-GPU resources and shut NVML down (not under a poll stuck in the driver)."""
        if not self._pollers.stop():
            log.warning("a GPU poll is still inside NVML: leaving NVML to the process exit")
            return
        if not self._discovering.acquire(timeout=1.0):
            log.warning("a look for new GPUs is still inside NVML: leaving NVML to the process "
                        "exit")
            return
        for device in self.devices:
            device.close()
        shutdown()
