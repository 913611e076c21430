"""What the agent needs from a source of GPU samples: NVML on a real node, the simulator else.

A source opens its GPUs when it is made and polls them when asked; it never schedules
itself. The agent runs it on its own thread (``gpumon.agent.scheduler``), so a source may
block (a hung NVML call) without slowing anything but its own next poll.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gpumon.collectors.samples import GpuSample, GpuStatic


class EventWatcher(Protocol):
    """A thread delivering a source's asynchronous events (NVML's XID errors)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


class GpuSource(Protocol):
    """A node's GPUs: static facts, one poll of every GPU, events, GPUs that appear later."""

    name: str
    driver_version: str
    nvml_version: str

    def statics(self) -> list[GpuStatic]: ...

    def sample(self, now: float, monotonic: float) -> list[GpuSample]: ...

    def xid_watcher(self, on_xid: Callable[[int, int], None]) -> EventWatcher | None: ...

    def discover(self) -> list[GpuStatic]: ...

    def close(self) -> None: ...
