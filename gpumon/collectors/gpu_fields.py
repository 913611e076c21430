"""The GPU fields: one row each, from where NVML gives it to what the agent does with it.

A field of ``GpuSample`` is read from NVML (``collectors/nvml/device.py``), exported as a
Prometheus family (``export/gpu_metrics.py``), written to a recording (``agent/recorder.py``)
and averaged over a step's window for the verdicts (``analysis/window.py``). Each of those
reads its part from this table, so a new field is a row here, its ``GpuSample`` attribute
and its test.

A row whose ``nvml`` names an NVML field id (``NVML_FI_...``) is a plain field value: the
device reads every such gauge in one ``nvmlDeviceGetFieldValues`` call, converts it with
``convert`` and forgets it for good on a GPU that answers NOT_SUPPORTED. The other rows name
the call that a reader of its own in ``device.py`` makes (a call answering several fields, a
counter with a rate, GPM); that reader takes ``convert`` from here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def ratio_from_percent(value: float) -> float:
    return value / 100.0


def watts_from_milliwatts(value: float) -> float:
    return value / 1000.0


def hertz_from_megahertz(value: float) -> float:
    return value * 1e6


def bytes_from_kib(value: float) -> float:
    return value * 1024


@dataclass(frozen=True, slots=True)
class GpuField:
    """One scalar field of a GPU sample."""

    name: str
    """The ``GpuSample`` attribute."""
    nvml: str
    """Where NVML gives it: a field id (``NVML_FI_...``), read generically, or the call its
    own reader makes."""
    convert: Callable[[float], float] = float
    """NVML's unit to the base unit."""
    metric: str | None = None
    """The exported family (a counter's without ``_total``); None: not exported."""
    help: str = ""
    kind: str = "gauge"
    """``gauge`` or ``counter`` (cumulative since driver load)."""
    record: str | None = None
    """Its key in a recording's ``gpu`` line; None: not recorded."""
    window: bool = False
    """Averaged over a step's window (``GpuWindow`` has an attribute of the same name)."""

    @property
    def field_value(self) -> bool:
        """Read generically, as an NVML field value."""
        return self.nvml.startswith("NVML_FI_") and self.kind == "gauge"


GPU_FIELDS: tuple[GpuField, ...] = (
    GpuField("utilization_ratio", "nvmlDeviceGetUtilizationRates().gpu", ratio_from_percent,
             "gpumon_gpu_utilization_ratio",
             "Fraction of time over the last sample period during which a kernel was running.",
             record="utilization", window=True),
    GpuField("memory_utilization_ratio", "nvmlDeviceGetUtilizationRates().memory",
             ratio_from_percent, "gpumon_gpu_memory_utilization_ratio",
             "Fraction of time over the last sample period during which device memory was "
             "read or written.", record="memory_utilization", window=True),
    GpuField("memory_used_bytes", "nvmlDeviceGetMemoryInfo().used", float,
             "gpumon_gpu_memory_used_bytes", "Device memory in use.",
             record="memory_used_bytes"),
    GpuField("memory_total_bytes", "nvmlDeviceGetMemoryInfo().total", float,
             "gpumon_gpu_memory_total_bytes", "Device memory in total.",
             record="memory_total_bytes"),
    GpuField("sm_active_ratio", "NVML_GPM_METRIC_SM_UTIL", ratio_from_percent,
             "gpumon_gpu_sm_active_ratio",
             "Fraction of SMs busy (GPM, Hopper and newer).", record="sm_active", window=True),
    GpuField("sm_occupancy_ratio", "NVML_GPM_METRIC_SM_OCCUPANCY", ratio_from_percent,
             "gpumon_gpu_sm_occupancy_ratio",
             "Resident warps over the theoretical maximum (GPM).", record="sm_occupancy",
             window=True),
    GpuField("tensor_active_ratio", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", ratio_from_percent,
             "gpumon_gpu_tensor_active_ratio",
             "Fraction of time the SMs ran any tensor-core instruction (GPM).",
             record="tensor_active", window=True),
    GpuField("dram_active_ratio", "NVML_GPM_METRIC_DRAM_BW_UTIL", ratio_from_percent,
             "gpumon_gpu_dram_active_ratio",
             "Device memory bandwidth used over its peak (GPM).", record="dram_active",
             window=True),
    GpuField("power_watts", "nvmlDeviceGetPowerUsage (mW)", watts_from_milliwatts,
             "gpumon_gpu_power_watts",
             "Power draw.", record="power_watts", window=True),
    GpuField("temperature_celsius", "nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)", float,
             "gpumon_gpu_temperature_celsius", "GPU core temperature.", window=True),
    GpuField("memory_temperature_celsius", "NVML_FI_DEV_MEMORY_TEMP", float,
             "gpumon_gpu_memory_temperature_celsius", "Device memory (HBM) temperature."),
    GpuField("sm_clock_hz", "nvmlDeviceGetClockInfo(NVML_CLOCK_SM) (MHz)", hertz_from_megahertz,
             "gpumon_gpu_sm_clock_hertz", "Current SM clock.", window=True),
    GpuField("pcie_tx_bytes_total", "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", float,
             "gpumon_gpu_pcie_transmit_bytes", "PCIe bytes sent by the GPU.", kind="counter"),
    GpuField("pcie_rx_bytes_total", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", float,
             "gpumon_gpu_pcie_receive_bytes", "PCIe bytes received by the GPU.",
             kind="counter"),
    GpuField("nvlink_tx_bytes_total", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX (KiB, all links)",
             bytes_from_kib, "gpumon_gpu_nvlink_transmit_bytes",
             "NVLink data bytes sent, all links.",
             kind="counter"),
    GpuField("nvlink_rx_bytes_total", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX (KiB, all links)",
             bytes_from_kib, "gpumon_gpu_nvlink_receive_bytes",
             "NVLink data bytes received, all links.", kind="counter"),
    # Rates of the counters above between two polls, for the verdicts (not exported:
    # Prometheus takes rates of the counters itself).
    GpuField("nvlink_tx_bytes_per_second", "rate of nvlink_tx_bytes_total",
             record="nvlink_tx_bytes_per_second", window=True),
    GpuField("nvlink_rx_bytes_per_second", "rate of nvlink_rx_bytes_total",
             record="nvlink_rx_bytes_per_second", window=True),
    GpuField("pcie_tx_bytes_per_second", "rate of pcie_tx_bytes_total",
             record="pcie_tx_bytes_per_second", window=True),
    GpuField("pcie_rx_bytes_per_second", "rate of pcie_rx_bytes_total",
             record="pcie_rx_bytes_per_second", window=True),
)

FIELDS_BY_NAME = {f.name: f for f in GPU_FIELDS}
