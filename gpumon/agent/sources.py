"""Which GPU source the agent runs on: the simulator when asked, NVML when it loads, else none.

No driver or no library is not an error: the agent still serves host and step metrics and
says why in its NVML status (``gpumon_nvml_up 0``, ``/readyz`` degraded).
"""

from __future__ import annotations

from collections.abc import Callable

from gpumon.agent.config import AgentConfig
from gpumon.collectors.base import GpuSource
from gpumon.state.node import NvmlStatus


def open_gpu_source(config: AgentConfig,
                    on_error: Callable[[str, str], None]) -> tuple[GpuSource | None, NvmlStatus]:
    """NVML, or the simulator when asked; ``None`` with a reason when neither is available."""
    if config.simulate:
        from gpumon.sim.gpus import SimulatedSource

        source = SimulatedSource(config.simulate)
        return source, NvmlStatus(up=True, driver_version=source.driver_version,
                                  nvml_version=source.nvml_version, simulated=True,
                                  message=f"simulating {config.simulate} GPUs")
    if not config.enabled("nvml"):
        return None, NvmlStatus(up=False, message="NVML collector disabled")
    from gpumon.collectors.nvml import NvmlSource, NvmlUnavailable

    try:
        nvml = NvmlSource(on_error, config.interval)
    except NvmlUnavailable as exc:
        return None, NvmlStatus(up=False, message=str(exc))
    return nvml, NvmlStatus(up=True, driver_version=nvml.driver_version,
                            nvml_version=nvml.nvml_version)


def given_source_status(source: GpuSource, simulated: bool) -> NvmlStatus:
    """The status of a source handed to the agent by its caller (``gpumon demo``'s simulator)."""
    return NvmlStatus(up=True, driver_version=source.driver_version,
                      nvml_version=source.nvml_version, simulated=simulated)
