"""Simulated GPUs: an NVML-shaped source for nodes without a driver (demo, tests, laptops).

Counters follow an :class:`Activity` per GPU. By default that activity drifts like a
training job that is mostly compute-bound; the job simulator sets it explicitly so the
counters follow what the simulated job does.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpumon.collectors.gpu_fields import GPU_FIELDS
from gpumon.collectors.samples import GpuSample, GpuStatic


@dataclass(frozen=True)
class GpuModel:
    """Published figures of one GPU model."""

    name: str
    memory_total_bytes: int
    nvlink_links: int
    nvlink_bytes_per_second: float  # per direction, all links
    pcie_bytes_per_second: float
    max_sm_clock_hz: float
    power_limit_watts: float
    architecture: str
    peak_flops: float | None = None
    """Dense BF16 tensor-core peak, FLOP/s (the datasheets' sparse figure halved)."""


H100_SXM = GpuModel(
    name="NVIDIA H100 80GB HBM3",
    memory_total_bytes=80 * 1024**3,
    nvlink_links=18,
    nvlink_bytes_per_second=450e9,
    pcie_bytes_per_second=64e9,
    max_sm_clock_hz=1980e6,
    power_limit_watts=700.0,
    architecture="hopper",
    peak_flops=989e12,
)

H200_SXM = GpuModel(
    name="NVIDIA H200",
    memory_total_bytes=141 * 1024**3,
    nvlink_links=18,
    nvlink_bytes_per_second=450e9,
    pcie_bytes_per_second=64e9,
    max_sm_clock_hz=1980e6,
    power_limit_watts=700.0,
    architecture="hopper",
    peak_flops=989e12,
)

GPU_MODELS = {"h100-sxm": H100_SXM, "h200-sxm": H200_SXM}
"""Simulated models by short name. Hopper parts only: the verdicts need GPM's SM, tensor and
DRAM activity, which older GPUs do not report."""


def gpu_model(name: str) -> GpuModel:
    """The simulated model called ``name`` (``h100-sxm``, ``h200-sxm``); ValueError otherwise."""
    try:
        return GPU_MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU model {name!r}; choose from "
                         f"{', '.join(GPU_MODELS)}") from None


@dataclass(frozen=True)
class Activity:
    """What a GPU is doing right now, as ratios of its peak."""

    utilization: float = 0.0
    sm_active: float = 0.0
    sm_occupancy: float = 0.0
    tensor_active: float = 0.0
    dram_active: float = 0.0
    nvlink_ratio: float = 0.0
    pcie_ratio: float = 0.0
    memory_used_bytes: int = 2 * 1024**3


def _drifting_activity(t: float, index: int) -> Activity:
    """A plausible busy training GPU whose counters drift over minutes."""
    wave = 0.5 + 0.5 * math.sin(t / 23.0 + index)
    busy = 0.80 + 0.15 * wave
    return Activity(
        utilization=busy,
        sm_active=busy - 0.08,
        sm_occupancy=0.35 + 0.1 * wave,
        tensor_active=0.45 + 0.2 * wave,
        dram_active=0.30 + 0.15 * (1 - wave),
        nvlink_ratio=0.05 + 0.25 * (1 - wave),
        pcie_ratio=0.02,
        memory_used_bytes=int((52 + 6 * wave) * 1024**3),
    )


class SimulatedSource:
    """N simulated GPUs of one model. Thread-safe; ``set_activity`` drives the counters."""

    name = "sim"
    driver_version = "simulated"
    nvml_version = "simulated"

    def __init__(self, count: int, model: GpuModel = H100_SXM, seed: int = 0) -> None:
        self.model = model
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._statics = [
            GpuStatic(
                index=i,
                uuid=f"GPU-5e1a0000-0000-4000-8000-{i:012x}",
                name=model.name,
                pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
                memory_total_bytes=model.memory_total_bytes,
                nvlink_link_count=model.nvlink_links,
                mig_enabled=False,
                gpm_supported=True,
                max_sm_clock_hz=model.max_sm_clock_hz,
                architecture=model.architecture,
            )
            for i in range(count)
        ]
        self._activity: dict[int, Activity] = {}
        self._counters = {i: dict.fromkeys(_COUNTERS, 0.0) for i in range(count)}
        self._last_t: float | None = None

    def statics(self) -> list[GpuStatic]:
        """Static facts of the simulated GPUs."""
        return list(self._statics)

    def set_activity(self, index: int, activity: Activity | None) -> None:
        """Pin what GPU ``index`` does; ``None`` returns it to the default drift."""
        with self._lock:
            if activity is None:
                self._activity.pop(index, None)
            else:
                self._activity[index] = activity

    def activity(self, index: int, t: float) -> Activity:
        """The activity GPU ``index`` has at time ``t``."""
        with self._lock:
            pinned = self._activity.get(index)
        return pinned if pinned is not None else _drifting_activity(t, index)

    def sample(self, now: float, monotonic: float) -> list[GpuSample]:
        """One poll of every simulated GPU."""
        dt = 0.0 if self._last_t is None else max(0.0, monotonic - self._last_t)
        self._last_t = monotonic
        return [self._sample_one(gpu, now, dt) for gpu in self._statics]

    def poll(self, now: float, monotonic: float,
             deliver: Callable[[list[GpuSample]], None],
             hand_over: Callable[[], None] | None = None) -> None:
        """The agent's cycle: the samples delivered at once (a simulated GPU never hangs)."""
        deliver(self.sample(now, monotonic))

    def _sample_one(self, gpu: GpuStatic, now: float, dt: float) -> GpuSample:
        a = self.activity(gpu.index, now)
        jitter = self._rng.uniform(-0.02, 0.02)
        m = self.model
        link = a.nvlink_ratio * m.nvlink_bytes_per_second
        pcie = a.pcie_ratio * m.pcie_bytes_per_second
        rates = {"nvlink_tx": link, "nvlink_rx": link, "pcie_tx": pcie, "pcie_rx": pcie * 0.5}
        counters = self._counters[gpu.index]
        counted: dict[str, Any] = {}
        for name in _COUNTERS:
            counters[name] += rates[name] * dt
            counted[f"{name}_bytes_total"] = int(counters[name])
            if dt:
                counted[f"{name}_bytes_per_second"] = rates[name]
        power = 90.0 + (m.power_limit_watts - 90.0) * _clip(0.15 + 0.85 * a.sm_active + jitter)
        temperature = 34.0 + 40.0 * _clip(power / m.power_limit_watts)
        clock = m.max_sm_clock_hz * (0.93 if a.sm_active > 0.9 else 1.0)
        return GpuSample(
            index=gpu.index,
            t=now,
            utilization_ratio=round(_clip(a.utilization + jitter), 2),
            memory_utilization_ratio=round(_clip(a.dram_active * 0.9 + jitter), 2),
            memory_used_bytes=a.memory_used_bytes,
            memory_total_bytes=m.memory_total_bytes,
            sm_active_ratio=_clip(a.sm_active + jitter),
            sm_occupancy_ratio=_clip(a.sm_occupancy + jitter / 2),
            tensor_active_ratio=_clip(a.tensor_active + jitter),
            dram_active_ratio=_clip(a.dram_active + jitter),
            power_watts=round(power, 1),
            temperature_celsius=round(temperature),
            sm_clock_hz=clock,
            clock_event_reasons={"gpu_idle": a.utilization < 0.05, "sw_power_cap": False,
                                 "hw_slowdown": False, "sw_thermal_slowdown": False,
                                 "hw_thermal_slowdown": False},
            ecc_errors_total={"corrected": 0, "uncorrected": 0},
            **counted,
        )

    def discover(self) -> list[GpuStatic]:
        """Simulated GPUs never appear later."""
        return []

    def watch_xids(self, on_xid: object) -> bool:
        """Simulated GPUs raise no XID events."""
        return False

    def close(self) -> None:
        """Nothing to release."""


_COUNTERS = tuple(f.name.removesuffix("_bytes_total") for f in GPU_FIELDS if f.kind == "counter")
"""The table's byte counters (``nvlink_tx``, ...); each has a ``_bytes_per_second`` rate."""


def _clip(x: float) -> float:
    return min(1.0, max(0.0, x))


__all__ = ["GPU_MODELS", "H100_SXM", "H200_SXM", "Activity", "GpuModel", "SimulatedSource",
           "gpu_model"]
