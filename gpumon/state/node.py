"""The node's state (GPUs, host, XIDs, collectors): written by collectors, read as a snapshot.

Collectors replace immutable samples under a short lock; a scrape copies references under
the same lock and renders outside it, so a slow collector never slows a scrape.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field

from gpumon.collectors.samples import GpuSample, GpuStatic, HostSample, ProcessSample
from gpumon.state.gpu_history import Packed, pack

GPU_HISTORY = 600  # samples kept per GPU (10 min at 1 s) for per-step windows


@dataclass
class CollectorStats:
    """How one collector is doing: last cycle, last success, errors by kind."""

    interval_s: float
    last_duration_s: float | None = None
    last_success_t: float | None = None
    last_attempt_t: float | None = None
    running_since_monotonic: float | None = None
    errors: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class NvmlStatus:
    """Whether NVML works on this node, and why not."""

    up: bool
    driver_version: str | None = None
    nvml_version: str | None = None
    message: str | None = None
    simulated: bool = False


@dataclass(frozen=True)
class NodeSnapshot:
    """A consistent copy of the state for one scrape or API call."""

    t: float
    nvml: NvmlStatus
    gpus: tuple[GpuStatic, ...]
    latest: dict[int, GpuSample]
    xid_counts: dict[tuple[int, int], int]
    host: HostSample | None
    processes: dict[int, ProcessSample]
    collectors: dict[str, CollectorStats]


class NodeState:
    """Bounded, thread-safe state of one node."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.nvml = NvmlStatus(up=False, message="not started")
        self._gpus: tuple[GpuStatic, ...] = ()
        self._latest: dict[int, GpuSample] = {}
        self._history: dict[int, deque[Packed]] = {}
        self._xid: Counter[tuple[int, int]] = Counter()
        self._host: HostSample | None = None
        self._processes: dict[int, ProcessSample] = {}
        self._collectors: dict[str, CollectorStats] = {}

    # -- writers -----------------------------------------------------------------
    def set_nvml(self, status: NvmlStatus, gpus: list[GpuStatic]) -> None:
        """Record NVML's status and the static facts of the GPUs found."""
        with self._lock:
            self.nvml = status
            self._gpus = tuple(gpus)
            for gpu in gpus:
                self._history.setdefault(gpu.index, deque(maxlen=GPU_HISTORY))

    def put_gpu_samples(self, samples: list[GpuSample]) -> None:
        """Store the newest sample per GPU and append it to that GPU's history."""
        with self._lock:
            for sample in samples:
                self._latest[sample.index] = sample
                history = self._history.setdefault(sample.index, deque(maxlen=GPU_HISTORY))
                history.append(pack(sample, history[-1] if history else None))

    def add_xid(self, gpu: int, xid: int) -> None:
        """Count one XID error on a GPU."""
        with self._lock:
            self._xid[(gpu, xid)] += 1

    def put_host(self, sample: HostSample, processes: dict[int, ProcessSample]) -> None:
        """Store the newest host and per-process readings."""
        with self._lock:
            self._host = sample
            self._processes = processes

    def collector(self, name: str, interval_s: float) -> CollectorStats:
        """The stats record of a collector, created on first use."""
        with self._lock:
            return self._collectors.setdefault(name, CollectorStats(interval_s=interval_s))

    def count_error(self, collector: str, error: str) -> None:
        """Count an error of a collector by kind."""
        with self._lock:
            stats = self._collectors.setdefault(collector, CollectorStats(interval_s=0.0))
            stats.errors[error] += 1

    # -- readers -----------------------------------------------------------------
    def gpu_history(self) -> dict[int, tuple[Packed, ...]]:
        """Every GPU's recent samples, packed (``state.gpu_history.window`` reads them), for
        per-step windows: copied once per analyzer pass, so the analyzer works from its own
        copy instead of calling back into this state."""
        with self._lock:
            return {index: tuple(history) for index, history in self._history.items()}

    def gpu_statics(self) -> tuple[GpuStatic, ...]:
        """Static facts of the node's GPUs."""
        with self._lock:
            return self._gpus

    def snapshot(self, now: float) -> NodeSnapshot:
        """A consistent copy for rendering outside the lock."""
        with self._lock:
            return NodeSnapshot(
                t=now,
                nvml=self.nvml,
                gpus=self._gpus,
                latest=dict(self._latest),
                xid_counts=dict(self._xid),
                host=self._host,
                processes=dict(self._processes),
                collectors={
                    name: CollectorStats(
                        interval_s=s.interval_s,
                        last_duration_s=s.last_duration_s,
                        last_success_t=s.last_success_t,
                        last_attempt_t=s.last_attempt_t,
                        running_since_monotonic=s.running_since_monotonic,
                        errors=Counter(s.errors),
                    )
                    for name, s in self._collectors.items()
                },
            )

