"""What the agent needs from a source of GPU samples: NVML on a real node, the simulator else.

A source opens its GPUs when it is made and polls them when asked; it never schedules
itself. The agent asks it on its clock's thread (``gpumon.agent.scheduler``) through
``poll``, which hands the samples on as they come. NVML's source polls on the asking thread,
watched: should a call hang, that GPU goes on on a thread of its own and the clock is handed
over to a fresh thread, so a hung NVML call slows nothing but that GPU's next sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gpumon.collectors.samples import GpuSample, GpuStatic


class GpuSource(Protocol):
    """A node's GPUs: static facts, one poll of every GPU, events, GPUs that appear later."""

    name: str
    driver_version: str
    nvml_version: str

    def statics(self) -> list[GpuStatic]: ...

    def sample(self, now: float, monotonic: float) -> list[GpuSample]: ...

    def poll(self, now: float, monotonic: float,
             deliver: Callable[[list[GpuSample]], None],
             hand_over: Callable[[], None] | None = None) -> None:
        """One cycle of the agent's schedule: every GPU's sample to ``deliver``, now or as
        its poll ends. ``hand_over()``, when given, may be called from another thread while
        this call is stuck in the driver: the caller's schedule must go on elsewhere."""

    def watch_xids(self, on_xid: Callable[[int, int], None]) -> bool:
        """Report the GPUs' XID errors (gpu, xid) to ``on_xid`` from now on, taken as the
        source polls; whether it can."""

    def discover(self) -> list[GpuStatic]: ...

    def close(self) -> None: ...
