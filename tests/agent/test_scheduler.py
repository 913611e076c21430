"""The collection schedule: cycles on a clock's grid, cycles of one interval woken together,
and one brought forward by ``wake()``."""

from __future__ import annotations

import threading

from gpumon.agent.scheduler import Clock, Periodic
from gpumon.state.node import NodeState
from tests.helpers import wait_for


class Runs:
    """The cycles a clock ran, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.names: list[str] = []

    def cycle(self, name: str, fail: bool = False):  # type: ignore[no-untyped-def]
        def run(now: float, monotonic: float) -> None:
            with self._lock:
                self.names.append(name)
            if fail:
                raise ValueError("a collector's bug")
        return run

    def count(self, name: str) -> int:
        with self._lock:
            return self.names.count(name)


def _clock(interval_s: float) -> tuple[Clock, Periodic, Runs]:
    runs = Runs()
    clock = Clock("gpumon-test-clock", NodeState())
    cycle = clock.every("counting", interval_s, runs.cycle("counting"))
    return clock, cycle, runs


def test_a_wake_runs_a_cycle_long_before_its_tick() -> None:
    clock, cycle, runs = _clock(3600.0)
    clock.start()
    try:
        wait_for(lambda: runs.count("counting") == 1, timeout=5, what="the first cycle")
        cycle.wake()
        wait_for(lambda: runs.count("counting") == 2, timeout=5, what="the woken cycle")
    finally:
        clock.stop()
        clock.join(5)
    assert not clock.is_alive()
    assert runs.count("counting") == 2


def test_a_burst_of_wakes_is_one_cycle() -> None:
    clock, cycle, runs = _clock(3600.0)
    clock.start()
    try:
        wait_for(lambda: runs.count("counting") == 1, timeout=5, what="the first cycle")
        for _ in range(50):
            cycle.wake()
        wait_for(lambda: runs.count("counting") >= 2, timeout=5, what="the woken cycle")
        cycle.wake()
        wait_for(lambda: runs.count("counting") >= 3, timeout=5, what="a later wake's cycle")
    finally:
        clock.stop()
        clock.join(5)
    # Fifty wakes while it waited: one cycle (two only had a wake landed mid-cycle).
    assert runs.count("counting") <= 4, runs.names


def test_stop_ends_a_clock_waiting_out_a_long_interval() -> None:
    clock, _, runs = _clock(3600.0)
    clock.start()
    wait_for(lambda: runs.names, timeout=5, what="the first cycle")
    clock.stop()
    clock.join(5)
    assert not clock.is_alive()
    assert runs.count("counting") == 1


def test_cycles_of_one_interval_run_on_one_wakeup_and_a_longer_one_on_their_ticks() -> None:
    runs = Runs()
    state = NodeState()
    clock = Clock("gpumon-test-clock", state)
    clock.every("poll", 0.05, runs.cycle("poll"))
    clock.every("housekeeping", 0.05, runs.cycle("housekeeping"))
    clock.every("host", 0.2, runs.cycle("host"))
    clock.every("broken", 0.05, runs.cycle("broken", fail=True))
    clock.start()
    try:
        wait_for(lambda: runs.count("poll") >= 20, timeout=30, what="twenty ticks")
    finally:
        clock.stop()
        clock.join(5)
    # Every wakeup ran both 0.05 s cycles (and the failing one: its errors are counted, the
    # clock goes on); the 0.2 s cycle ran on some of the same wakeups, never on one of its own.
    assert runs.count("poll") == runs.count("housekeeping") == runs.count("broken") \
        == clock.wakeups
    assert 1 <= runs.count("host") < clock.wakeups
    assert runs.names[:4] == ["poll", "housekeeping", "host", "broken"]
    assert state.snapshot(0.0).collectors["broken"].errors["valueerror"] == clock.wakeups
    assert state.snapshot(0.0).collectors["poll"].last_success_t is not None


def test_a_cycle_stuck_in_a_call_hands_its_clock_to_a_fresh_thread() -> None:
    """The stuck thread ends when its call returns, without running another cycle; the
    others go on meanwhile, on the clock's new thread."""
    state, runs, release = NodeState(), Runs(), threading.Event()
    threads: dict[str, set[str | int]] = {"stuck": set(), "beat": set()}
    calls = {"stuck": 0}

    def stuck(now: float, monotonic: float) -> None:
        calls["stuck"] += 1
        threads["stuck"].add(threading.get_ident())
        if calls["stuck"] == 2:  # its second cycle hangs until released
            stuck_cycle.hand_over()  # (what a watchdog says, from its own thread)
            release.wait(10)

    def beat(now: float, monotonic: float) -> None:
        threads["beat"].add(threading.get_ident())
        runs.cycle("beat")(now, monotonic)

    clock = Clock("gpumon-test-clock", state)
    stuck_cycle = clock.every("stuck", 0.05, stuck)
    clock.every("beat", 0.05, beat)
    clock.start()
    try:
        first = clock.ident
        wait_for(lambda: clock.hand_overs == 1, timeout=5, what="the hand-over")
        beats = runs.count("beat")
        wait_for(lambda: runs.count("beat") >= beats + 5, timeout=5,
                 what="the other cycle going on while one is stuck")
        assert clock.ident != first and clock.is_alive()
        old = next(t for t in threading.enumerate() if t.ident == first)
        release.set()
        old.join(5)
        assert not old.is_alive()  # it ended once its call returned
        wait_for(lambda: calls["stuck"] >= 4, timeout=5, what="the stuck cycle again")
        assert len(threads["stuck"]) == 2 and len(threads["beat"]) == 2
    finally:
        release.set()
        clock.stop()
        clock.join(5)
    assert not clock.is_alive()
