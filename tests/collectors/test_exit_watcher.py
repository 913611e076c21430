"""The moment each watched process exits, from its pidfd, and when it started, from the kernel."""

from __future__ import annotations

import subprocess
import sys
import time

from gpumon.collectors.liveness import ExitWatcher, started_monotonic


def test_an_exit_is_known_at_its_moment_and_a_start_from_the_kernel() -> None:
    watcher = ExitWatcher()
    watcher.start()
    try:
        before = time.monotonic()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
        started = started_monotonic(child.pid)
        assert started is not None and before - 0.05 <= started <= time.monotonic()
        assert watcher.watch(child.pid) and not watcher.watch(child.pid)  # once
        deadline = time.monotonic() + 5
        exits: dict[int, float] = {}
        while child.pid not in exits and time.monotonic() < deadline:
            exits.update(watcher.take())
            time.sleep(0.05)
        ended = time.monotonic()
        child.wait()  # reaped only now: the exit was seen while it was a zombie
        assert child.pid in exits and before + 0.4 <= exits[child.pid] <= ended
        assert watcher.take() == {}
    finally:
        watcher.close()
        watcher.close()  # idempotent


def test_a_process_already_gone_is_an_exit_now_and_no_pidfds_means_no_watch() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    watcher = ExitWatcher()
    try:
        assert watcher.watch(child.pid)
        assert child.pid in watcher.take()
        assert started_monotonic(child.pid) is None
        watcher.available = False  # a kernel without pidfds: the periodic check tells exits
        assert not watcher.watch(child.pid + 1)
    finally:
        watcher.close()
