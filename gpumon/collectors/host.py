"""Host collector: CPU and memory of the node, and of the training processes (psutil)."""

from __future__ import annotations

from collections.abc import Iterable

import psutil

from gpumon.collectors.samples import HostSample, ProcessSample


class HostSource:
    """Reads host-wide CPU/memory; ``cpu_percent`` is measured since the previous call."""

    name = "host"

    def __init__(self) -> None:
        psutil.cpu_percent(interval=None)  # prime the delta
        self._processes: dict[int, psutil.Process] = {}

    def sample(self, now: float) -> HostSample:
        """One reading of the node."""
        memory = psutil.virtual_memory()
        return HostSample(
            t=now,
            cpu_utilization_ratio=psutil.cpu_percent(interval=None) / 100.0,
            memory_used_bytes=int(memory.total - memory.available),
            memory_total_bytes=int(memory.total),
        )

    def processes(self, pids: Iterable[int]) -> dict[int, ProcessSample]:
        """CPU seconds and RSS of each live pid; vanished ones are left out."""
        out: dict[int, ProcessSample] = {}
        wanted = set(pids)
        for pid in list(self._processes):
            if pid not in wanted:
                del self._processes[pid]
        for pid in wanted:
            try:
                process = self._processes.get(pid) or psutil.Process(pid)
                self._processes[pid] = process
                with process.oneshot():
                    times = process.cpu_times()
                    rss = process.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                self._processes.pop(pid, None)
                continue
            out[pid] = ProcessSample(pid=pid, cpu_seconds_total=times.user + times.system,
                                     resident_memory_bytes=int(rss))
        return out
