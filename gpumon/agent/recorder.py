"""`--record FILE.jsonl`: append every step record and GPU sample the agent sees.

Step lines are wire records (kind "step"); GPU lines follow the recording format in docs/architecture.md §6.
Writes are buffered and flushed at least every second by the caller's housekeeping, so a
recording costs the ingest path one list append.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.wire import StepRecord, to_wire

# GpuSample field -> recording key.
_GPU_KEYS = (
    ("utilization_ratio", "utilization"),
    ("memory_utilization_ratio", "memory_utilization"),
    ("memory_used_bytes", "memory_used_bytes"),
    ("memory_total_bytes", "memory_total_bytes"),
    ("sm_active_ratio", "sm_active"),
    ("sm_occupancy_ratio", "sm_occupancy"),
    ("tensor_active_ratio", "tensor_active"),
    ("dram_active_ratio", "dram_active"),
    ("nvlink_tx_bytes_per_second", "nvlink_tx_bytes_per_second"),
    ("nvlink_rx_bytes_per_second", "nvlink_rx_bytes_per_second"),
    ("pcie_tx_bytes_per_second", "pcie_tx_bytes_per_second"),
    ("pcie_rx_bytes_per_second", "pcie_rx_bytes_per_second"),
    ("power_watts", "power_watts"),
)


def gpu_line(sample: GpuSample, static: GpuStatic | None = None) -> dict[str, Any]:
    """A GPU sample as a recording line; ``uuid`` and ``model`` let a replay attribute ranks."""
    line: dict[str, Any] = {"kind": "gpu", "t": sample.t, "gpu": sample.index}
    if static is not None:
        line["uuid"] = static.uuid
        line["model"] = static.name
    for field, key in _GPU_KEYS:
        value = getattr(sample, field)
        if value is not None:
            line[key] = value
    if sample.process_memory_bytes:
        line["processes"] = {str(pid): used for pid, used in sample.process_memory_bytes.items()}
    if not sample.up:
        line["up"] = False
    return line


def sample_from_line(line: dict[str, Any]) -> GpuSample:
    """Inverse of :func:`gpu_line` (for replaying recordings)."""
    values = {field: line[key] for field, key in _GPU_KEYS if key in line}
    processes = line.get("processes")
    if isinstance(processes, dict):
        values["process_memory_bytes"] = {int(pid): int(used) for pid, used in processes.items()}
    return GpuSample(index=int(line["gpu"]), t=float(line["t"]), up=line.get("up", True),
                     **values)


class Recorder:
    """Appends lines to a JSONL file; thread-safe, buffered."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def steps(self, records: Iterable[StepRecord]) -> None:
        """Queue step records."""
        lines = [json.dumps(to_wire(r), separators=(",", ":")) for r in records]
        with self._lock:
            self._pending.extend(lines)

    def gpus(self, samples: Iterable[GpuSample], statics: Iterable[GpuStatic] = ()) -> None:
        """Queue GPU samples."""
        by_index = {s.index: s for s in statics}
        lines = [json.dumps(gpu_line(s, by_index.get(s.index)), separators=(",", ":"))
                 for s in samples]
        with self._lock:
            self._pending.extend(lines)

    def flush(self) -> None:
        """Write what is queued."""
        with self._lock:
            pending, self._pending = self._pending, []
            if pending:
                self._file.write("\n".join(pending) + "\n")
                self._file.flush()

    def close(self) -> None:
        """Flush and close the file."""
        self.flush()
        with self._lock:
            self._file.close()
