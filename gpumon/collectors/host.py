"""Host collector: CPU and memory of the node (/proc), and of the training processes
(psutil)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import psutil

from gpumon.collectors.samples import HostSample, ProcessSample

PROC_STAT = "/proc/stat"
PROC_MEMINFO = "/proc/meminfo"


class HostSource:
    """Reads host-wide CPU and memory; the CPU's busy share is measured since the previous
    reading.

    The node's two figures are read from /proc directly, the way psutil's ``cpu_percent`` and
    ``virtual_memory`` read them: the first line of /proc/stat and the head of /proc/meminfo.
    psutil parses every line of both, and its helpers cost five times the reads; this runs on
    the agent's clock whatever the node does.
    """

    name = "host"

    def __init__(self, stat_path: str = PROC_STAT, meminfo_path: str = PROC_MEMINFO) -> None:
        self._stat_path = stat_path
        self._meminfo_path = meminfo_path
        self._cpu = cpu_times(self._head(stat_path, 1)[0])  # the delta's start
        self._processes: dict[int, psutil.Process] = {}

    def sample(self, now: float) -> HostSample:
        """One reading of the node."""
        busy, total = cpu_times(self._head(self._stat_path, 1)[0])
        busy0, total0 = self._cpu
        self._cpu = (busy, total)
        elapsed = total - total0
        ratio = min(max((busy - busy0) / elapsed, 0.0), 1.0) if elapsed > 0 else 0.0
        memory_total, available = memory_kib(self._head(self._meminfo_path, 3))
        return HostSample(
            t=now,
            cpu_utilization_ratio=ratio,
            memory_used_bytes=(memory_total - available) * 1024,
            memory_total_bytes=memory_total * 1024,
        )

    @staticmethod
    def _head(path: str, lines: int) -> list[bytes]:
        """The first ``lines`` lines of a /proc file, in one read (they lead the file)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, 4096).split(b"\n", lines)[:lines]
        finally:
            os.close(fd)

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


def cpu_times(line: bytes) -> tuple[int, int]:
    """(busy, total) clock ticks of /proc/stat's ``cpu`` line, as psutil counts them: idle and
    iowait are not busy, and guest time is already inside user and nice."""
    fields = [int(f) for f in line.split()[1:9]]
    fields += [0] * (8 - len(fields))  # old kernels lack steal (and before it, irq)
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    total = user + nice + system + idle + iowait + irq + softirq + steal
    return total - idle - iowait, total


def memory_kib(head: list[bytes]) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in KiB from the head of /proc/meminfo. A kernel without
    MemAvailable (before 3.14) gives MemFree for it."""
    values = {}
    for line in head:
        name, _, rest = line.partition(b":")
        values[name] = int(rest.split()[0])
    return values[b"MemTotal"], values.get(b"MemAvailable", values[b"MemFree"])
