"""The collection schedule: a cycle every interval, and one brought forward by ``wake()``."""

from __future__ import annotations

import threading

from gpumon.agent.scheduler import Periodic
from gpumon.state.node import NodeState
from tests.helpers import wait_for


def _counting(interval_s: float) -> tuple[Periodic, list[float]]:
    cycles: list[float] = []
    lock = threading.Lock()

    def cycle(now: float, monotonic: float) -> None:
        with lock:
            cycles.append(monotonic)

    return Periodic("counting", interval_s, cycle, NodeState()), cycles


def test_a_wake_runs_a_cycle_long_before_its_tick() -> None:
    thread, cycles = _counting(3600.0)
    thread.start()
    try:
        wait_for(lambda: len(cycles) == 1, timeout=5, what="the first cycle")
        thread.wake()
        wait_for(lambda: len(cycles) == 2, timeout=5, what="the woken cycle")
    finally:
        thread.stop()
        thread.join(5)
    assert not thread.is_alive()
    assert len(cycles) == 2


def test_a_burst_of_wakes_is_one_cycle() -> None:
    thread, cycles = _counting(3600.0)
    thread.start()
    try:
        wait_for(lambda: len(cycles) == 1, timeout=5, what="the first cycle")
        for _ in range(50):
            thread.wake()
        wait_for(lambda: len(cycles) >= 2, timeout=5, what="the woken cycle")
        thread.wake()
        wait_for(lambda: len(cycles) >= 3, timeout=5, what="a later wake's cycle")
    finally:
        thread.stop()
        thread.join(5)
    # Fifty wakes while it waited: one cycle (two only had a wake landed mid-cycle).
    assert len(cycles) <= 4, cycles


def test_stop_ends_a_thread_waiting_out_a_long_interval() -> None:
    thread, cycles = _counting(3600.0)
    thread.start()
    wait_for(lambda: cycles, timeout=5, what="the first cycle")
    thread.stop()
    thread.join(5)
    assert not thread.is_alive()
    assert len(cycles) == 1
