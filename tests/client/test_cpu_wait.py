"""The training thread's wait for a CPU (``cpu_wait``), read from the kernel's run delay."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpumon.client.watchers.cpu_wait import SCHEDSTAT, CpuWaitClock


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def stolen_s(core: int) -> float:
    """Seconds the hypervisor has kept ``core`` (a virtual CPU) from running, so far."""
    for line in Path("/proc/stat").read_text().splitlines():
        fields = line.split()
        if fields[0] == f"cpu{core}":
            return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    return 0.0


def test_a_thread_sharing_its_core_waits_and_the_step_says_how_long() -> None:
    """Two spinning processes pinned with this one to one core: the measured thread is
    runnable, not running, most of the time. Ground truth: wall time less its own CPU time,
    which for a thread that only spins is its wait for the core, and, in a virtual machine,
    the time the host took the core from it (steal: not a wait the guest's kernel sees, so
    not run delay; a loaded host stole 57 ms of a 0.55 s window once)."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.fail("cpu_wait is a Linux measurement; this test needs Linux")
    before = os.sched_getaffinity(0)
    core = min(before)
    rivals = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for rival in rivals:
            os.sched_setaffinity(rival.pid, {core})
        os.sched_setaffinity(0, {core})
        clock = CpuWaitClock()
        fields: dict[str, object] = {}
        stolen = stolen_s(core)
        w0, c0 = time.perf_counter(), time.thread_time()
        clock.step_begin()
        spin(0.3)
        clock.step_end(fields)
        off_cpu = (time.perf_counter() - w0) - (time.thread_time() - c0)
        stolen = stolen_s(core) - stolen + 0.01  # counted in ticks of 10 ms
    finally:
        os.sched_setaffinity(0, before)
        for rival in rivals:
            rival.kill()
            rival.wait()
    wait = fields["cpu_wait"]
    assert isinstance(wait, float)
    assert off_cpu > 0.1  # it did share the core
    assert off_cpu - stolen - 0.02 - 0.1 * off_cpu <= wait <= off_cpu + 0.02 + 0.1 * off_cpu, \
        (wait, off_cpu, stolen)


def schedstat(path: Path, run_delay_ns: int) -> None:
    """Write what the kernel shows in ``schedstat``: run time, run delay (ns), time slices."""
    path.write_text(f"123456789 {run_delay_ns} 42\n")


def test_the_field_is_the_run_delay_gained_within_the_step(tmp_path: Path) -> None:
    """Against a file the test writes, standing in for the kernel's: exact, on any machine."""
    path = tmp_path / "schedstat"
    schedstat(path, 5_000_000)
    clock = CpuWaitClock(str(path))
    fields: dict[str, object] = {}
    clock.step_begin()
    schedstat(path, 8_250_000)  # the thread waited 3.25 ms for a CPU during the step
    clock.step_end(fields)
    assert fields == {"cpu_wait": 0.00325}
    clock.step_begin()  # a step that never waited
    clock.step_end(fields)
    assert fields == {"cpu_wait": 0.0}
    clock.step_begin()
    schedstat(path, 1_000)  # a counter that went back (never seen) is no negative wait
    clock.step_end(fields)
    assert fields == {"cpu_wait": 0.0}


def test_a_step_ending_on_another_thread_carries_no_reading() -> None:
    clock = CpuWaitClock()
    clock.step_begin()
    fields: dict[str, object] = {}
    other = threading.Thread(target=clock.step_end, args=(fields,))
    other.start()
    other.join()
    assert fields == {}
    clock.step_begin()
    clock.step_end(fields)  # and the next step on the first thread is measured again
    assert "cpu_wait" in fields


@pytest.mark.parametrize("content", ["", "12 notanumber 3\n", "12\n"])
def test_an_unreadable_file_means_not_measured_and_is_not_read_again(
        tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpumon.client")
    path = tmp_path / "schedstat"
    path.write_text(content)
    clock = CpuWaitClock(str(path))
    fields: dict[str, object] = {}
    clock.step_begin()
    clock.step_end(fields)
    assert fields == {} and clock.unavailable
    assert "not measured" in caplog.text
    path.write_text("1 2 3\n")
    clock.step_begin()
    clock.step_end(fields)
    assert fields == {}


def test_a_missing_file_means_not_measured(tmp_path: Path) -> None:
    clock = CpuWaitClock(str(tmp_path / "absent"))
    fields: dict[str, object] = {}
    clock.step_begin()
    clock.step_end(fields)
    assert fields == {} and clock.unavailable


def test_this_kernel_reports_run_delay() -> None:
    # The e2e tests read cpu_wait as evidence; on a kernel without it they would prove nothing.
    assert len(Path(SCHEDSTAT).read_text().split()) == 3
