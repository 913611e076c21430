"""The host source's readings of /proc: against psutil's on this machine, and on kernels'
files of other shapes."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from gpumon.collectors.host import HostSource, cpu_times, memory_kib


def test_the_node_reads_as_psutil_reads_it() -> None:
    source = HostSource()
    psutil.cpu_percent(interval=None)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # some busy time in the interval
        pass
    sample = source.sample(time.time())
    theirs = psutil.cpu_percent(interval=None) / 100.0
    memory = psutil.virtual_memory()
    assert 0.0 < sample.cpu_utilization_ratio <= 1.0
    assert abs(sample.cpu_utilization_ratio - theirs) <= 0.05, (sample, theirs)
    assert sample.memory_total_bytes == memory.total
    assert abs((memory.total - memory.available) - sample.memory_used_bytes) <= 64 << 20


def test_the_busy_share_is_of_the_interval_since_the_last_reading(tmp_path: Path) -> None:
    stat, meminfo = tmp_path / "stat", tmp_path / "meminfo"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 50 0 0 0 40 0\ncpu0 1 2 3 4\n")
    meminfo.write_text("MemTotal: 1000 kB\nMemFree: 200 kB\nMemAvailable: 600 kB\n")
    source = HostSource(str(stat), str(meminfo))
    stat.write_text("cpu  160 0 70 900 70 0 0 0 60 0\ncpu0 1 2 3 4\n")  # 80 busy of 200
    sample = source.sample(0.0)
    assert sample.cpu_utilization_ratio == 0.4
    assert (sample.memory_total_bytes, sample.memory_used_bytes) == (1000 * 1024, 400 * 1024)
    assert source.sample(1.0).cpu_utilization_ratio == 0.0  # no ticks since: not a division


def test_older_kernels_files() -> None:
    assert cpu_times(b"cpu  10 0 5 80 5 1 1") == (17, 102)  # no steal column
    assert memory_kib([b"MemTotal: 900 kB", b"MemFree: 100 kB", b"Buffers: 5 kB"]) == (900, 100)
