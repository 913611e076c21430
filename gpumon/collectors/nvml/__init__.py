"""NVML collector: the only package of gpumon that imports ``pynvml`` (nvidia-ml-py).

``device`` reads one GPU (every call through one query helper: NOT_SUPPORTED is a remembered
absence, a missing symbol falls back to the older one, learnt once per process, a GPU off
the bus raises ``GpuLost``);
``library`` loads and releases NVML and names its errors;
``source`` discovers the node's GPUs, polls them (``pollers``) and, with them, the XID events.
"""

from gpumon.collectors.nvml.device import CLOCK_EVENT_REASONS, NvmlDevice
from gpumon.collectors.nvml.field_values import ALL_LINKS_SCOPE
from gpumon.collectors.nvml.library import GpuLost, NvmlUnavailable, error_name, init, shutdown
from gpumon.collectors.nvml.source import NvmlSource, XidEvents

__all__ = [
    "ALL_LINKS_SCOPE",
    "CLOCK_EVENT_REASONS",
    "GpuLost",
    "NvmlDevice",
    "NvmlSource",
    "NvmlUnavailable",
    "XidEvents",
    "error_name",
    "init",
    "shutdown",
]
