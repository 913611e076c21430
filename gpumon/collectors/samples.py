"""Plain, unit-bearing samples produced by collectors. No Prometheus types here.

A field is ``None`` when the source does not provide it (NOT_SUPPORTED, no GPM, ...):
absence is absence, never a fake zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GpuStatic:
    """Facts about one GPU that do not change while the agent runs."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int | None = None
    nvlink_link_count: int | None = None
    mig_enabled: bool | None = None
    gpm_supported: bool = False
    max_sm_clock_hz: float | None = None
    architecture: str | None = None


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One poll of one GPU. Ratios are 0–1; counters are cumulative since driver load."""

    index: int
    t: float
    up: bool = True
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    pcie_tx_bytes_total: int | None = None
    pcie_rx_bytes_total: int | None = None
    nvlink_tx_bytes_total: int | None = None
    nvlink_rx_bytes_total: int | None = None
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    sm_clock_hz: float | None = None
    clock_event_reasons: dict[str, bool] | None = None
    ecc_errors_total: dict[str, int] | None = None
    process_memory_bytes: dict[int, int] | None = None
    # Rates derived from consecutive counter readings (bytes/s), for the classifier.
    nvlink_tx_bytes_per_second: float | None = None
    nvlink_rx_bytes_per_second: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class HostSample:
    """One poll of the host."""

    t: float
    cpu_utilization_ratio: float
    memory_used_bytes: int
    memory_total_bytes: int


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """CPU and memory of one training process."""

    pid: int
    cpu_seconds_total: float
    resident_memory_bytes: int
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SenderCredentials:
    """Who sent a datagram, as the kernel tells it (SCM_CREDENTIALS), when known."""

    pid: int | None = None
    uid: int | None = None


OWNER_LABELS = ("node", "pod", "namespace", "container", "slurm_job", "slurm_step", "user")
"""The labels that say whose a process is (``gpumon_rank_info``, ``gpumon_gpu_owner_info``)."""


@dataclass(frozen=True, slots=True)
class Owner:
    """Whose a process (or a GPU's holder) is, as the agent verified it: the kernel's view of
    the process (its cgroup, its uid) and the kubelet's names. Empty where unknown or where it
    does not apply (no pod on a Slurm node, no Slurm job in a pod)."""

    node: str = ""
    pod: str = ""
    namespace: str = ""
    container: str = ""
    slurm_job: str = ""
    slurm_step: str = ""
    user: str = ""

    def labels(self) -> list[str]:
        """Label values in ``OWNER_LABELS`` order."""
        return [self.node, self.pod, self.namespace, self.container, self.slurm_job,
                self.slurm_step, self.user]

