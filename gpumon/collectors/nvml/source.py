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


XID_CHECK_INDEX = -1
"""The XID check's place among the pollers' devices: before the GPUs, and not one of them."""


class XidEvents:
    """The node's XID critical-error events, taken without waiting at every poll round.

    It is polled with the GPUs (``PollerSet``, as a pollable whose index is not a GPU's): each
    round drains the event set with a zero timeout, on the thread already awake for the GPUs,
    so an event is reported within one interval of its arrival. A thread of its own waiting on
    the set woke once a second on a quiet node, which cost more than the check. Should the
    check hang (a wedged driver), the pollers isolate it as they do a GPU, and the GPUs keep
    their schedule.
    """

    index = XID_CHECK_INDEX

    def __init__(self, on_xid: Callable[[int, int], None],
                 on_error: Callable[[str, str], None]) -> None:
        self._on_xid = on_xid
        self._on_error = on_error
        self._event_set: Any = None
        self._index_by_uuid: dict[str, int] = {}
        self.registered: list[int] = []
        self._check: Callable[[], Any] | None = None
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            on_error("xid", error_name(exc))

    @property
    def watching(self) -> bool:
        """Whether any GPU's events are registered."""
        return bool(self.registered)

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

    def sample(self, now: float, monotonic: float) -> None:
        """Report every event waiting in the set; returns no sample (it is not a GPU). A
        failure is counted once per round, never retried in the round."""
        if not self.registered:
            return None
        check = self._check
        if check is None:
            check = self._check = self.prepared_check()
        while True:
            try:
                data = check()
            except pynvml.NVMLError as exc:
                self._on_error("xid", error_name(exc))
                return None
            if data is None:  # none waiting: the common case
                return None
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                try:
                    uuid = text(pynvml.nvmlDeviceGetUUID(data.device))
                except pynvml.NVMLError:
                    uuid = ""
                self._on_xid(self._index_by_uuid.get(uuid, -1), int(data.eventData))

    def prepared_check(self, timeout_ms: int = 0) -> Callable[[], Any]:
        """One look at the set: the event's data, None when none came within ``timeout_ms``
        (none waiting, at 0), an ``NVMLError`` otherwise. Its entry point and arguments are
        made once, and the timeout is a return code, not an exception raised and caught at
        every round (the binding's)."""
        try:
            fn = pynvml._nvmlGetFunctionPointer("nvmlEventSetWait_v2")
        except pynvml.NVMLError as exc:  # counted as the check's error, as any other
            missing = exc

            def fail() -> Any:
                raise missing

            return fail
        data = pynvml.c_nvmlEventData_t()
        args = (self._event_set, ctypes.byref(data), ctypes.c_uint(timeout_ms))
        timeout, success = pynvml.NVML_ERROR_TIMEOUT, pynvml.NVML_SUCCESS

        def check() -> Any:
            ret = fn(*args)
            if ret == success:
                return data
            if ret == timeout:
                return None
            raise pynvml.NVMLError(ret)

        return check

    def close(self) -> None:
        """Free the event set (once no round is inside it)."""
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError:
                pass
            self._event_set = None


class NvmlSource:
    """All GPUs of the node through NVML: discovery, polling and XID events.

    Every index NVML counts is exported: a GPU that cannot be opened (lost to the bus before
    the agent started, say after an Xid 79) is a down GPU with the labels that can be known,
    and opening it is tried again at every discovery. The agent's clock polls every GPU
    (``PollerSet``), and with them the XID events once they are watched (``watch_xids``);
    one whose calls overrun is moved to a thread of its own, and marked down once they hang,
    without delaying the others.
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
        self._xids: XidEvents | None = None
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
            if self._xids is not None:
                self._xids.register(device)
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
             deliver: Callable[[list[GpuSample]], None],
             hand_over: Callable[[], None] | None = None) -> None:
        """The agent's cycle (``PollerSet.cycle``): the shared round on this thread, watched
        (given ``hand_over``), an isolated GPU's on its own; each round's samples delivered as
        it ends. A hanging GPU and an unopened one are delivered as down on this thread."""
        self._pollers.cycle(now, monotonic, deliver, hand_over)
        unopened = dict(self.unopened)  # a look for new GPUs may be changing it
        if unopened:
            deliver([GpuSample(index=i, t=now, up=False, error=error)
                     for i, error in sorted(unopened.items())])

    def _timed_out(self, index: int) -> None:
        log.error("GPU %d: NVML calls take over %.0f s; marking it down until it answers in "
                  "time", index, self._pollers.timeout_s)
        self._on_error("nvml", "timeout")

    def watch_xids(self, on_xid: Callable[[int, int], None]) -> bool:
        """Report XID events (gpu, xid) to ``on_xid`` from now on, also of GPUs found later,
        taken at each poll round (``XidEvents``); whether any GPU's can be watched."""
        with self._discovering:
            if self._xids is None:
                self._xids = XidEvents(on_xid, self._on_error)
                for device in self.devices:
                    self._xids.register(device)
                self._pollers.add(self._xids)
        return self._xids.watching

    def close(self) -> None:
        """Free per-GPU resources and shut NVML down (not under a poll stuck in the driver)."""
        if not self._pollers.stop():
            log.warning("a GPU poll is still inside NVML: leaving NVML to the process exit")
            return
        if not self._discovering.acquire(timeout=1.0):
            log.warning("a look for new GPUs is still inside NVML: leaving NVML to the process "
                        "exit")
            return
        if self._xids is not None:
            self._xids.close()
        for device in self.devices:
            device.close()
        shutdown()
