"""The agent's collection schedule: cycles on clocks, timed, errors counted.

A ``Clock`` is a thread that runs its cycles (``Periodic``), each every its own interval, on
one grid: cycles of one interval fall on the same ticks, and one of 5 s on every fifth tick
of one of 1 s. The agent's own cycles, which wait on nothing outside the process
(housekeeping, the GPU poll's clock, whose NVML calls run on worker threads of their own, the
host), share one clock: at a 1 s interval each thread woken costs about what the eight GPUs'
NVML calls do, and a shared clock wakes once a tick. A cycle that may wait on something else
(the kubelet's API) gets a clock of its own, so that a slow or hung source delays nothing but
itself.

A cycle stuck in a call may hand its clock over (``Periodic.hand_over``, from another thread:
the GPU poll's watchdog): a fresh thread goes on with the schedule, the cycle that is due
first, and the stuck one ends when its call returns, without running another cycle.

Each cycle's start, duration and success are written to its collector's stats in the node
state, where ``/readyz`` sees a cycle that is stuck and ``gpumon_collector_duration_seconds``
reports how long the last one took.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from gpumon.state.node import CollectorStats, NodeState

log = logging.getLogger(__name__)


WAKE_COALESCE_S = 0.2
"""After a wake, how long the cycle waits for others to join it: a burst of wakes (a job's
ranks starting together) is one cycle, not one each."""


class Periodic:
    """``fn(now, monotonic)`` every ``interval_s`` on its clock, timed, its errors counted by
    kind. ``wake()`` brings the next cycle forward.

    A cycle that goes on after ``fn`` returns, on threads of its own (``finishes_later``:
    NVML's pollers hand their samples on as they come), is timed, and its success marked, by
    whoever ends it; here only its start, errors and a stuck call are seen."""

    def __init__(self, clock: Clock, name: str, interval_s: float,
                 fn: Callable[[float, float], None], finishes_later: bool = False) -> None:
        self.collector = name
        self.interval_s = interval_s
        self.finishes_later = finishes_later
        self._clock = clock
        self._fn = fn
        self.stats: CollectorStats | None = None
        self.tick = -math.inf
        """When the next cycle is due on the clock's grid (monotonic)."""
        self.woken: float | None = None
        """When a wake asked for a cycle not yet run (monotonic), or None."""

    def due(self) -> float:
        """When this cycle should run next."""
        return self.tick if self.woken is None else min(self.tick, self.woken + WAKE_COALESCE_S)

    def wake(self) -> None:
        """Run the next cycle now (within ``WAKE_COALESCE_S``) rather than at its tick; wakes
        during a cycle bring one more cycle right after it. Never blocks on the cycle."""
        self._clock.wake(self)

    def hand_over(self) -> None:
        """This cycle's thread is stuck in a call (said from another thread): its clock goes
        on on a fresh thread, this cycle first (it is due again)."""
        self._clock.hand_over()

    def run(self, state: NodeState, logged: set[tuple[str, str]]) -> None:
        """One cycle, on the clock's thread."""
        stats = self.stats
        if stats is None:
            stats = self.stats = state.collector(self.collector, self.interval_s)
        started = time.monotonic()
        stats.running_since_monotonic = started
        stats.last_attempt_t = time.time()
        try:
            self._fn(stats.last_attempt_t, started)
        except Exception as exc:  # a collector failure must never stop the agent
            # An error may name its kind (``kind``); else its class does.
            kind = getattr(exc, "kind", None) or type(exc).__name__
            state.count_error(self.collector, kind.lower())
            if (self.collector, kind) not in logged:
                logged.add((self.collector, kind))
                log.exception("collector %s failed (further %s errors are only counted)",
                              self.collector, kind)
        else:
            if not self.finishes_later:
                stats.last_success_t = stats.last_attempt_t
        finally:
            stats.running_since_monotonic = None
            if not self.finishes_later:
                stats.last_duration_s = time.monotonic() - started


class Clock:
    """A thread running its cycles, each on the grid of its interval from the clock's start
    (a cycle that overran skips the ticks it missed rather than bursting). Started, stopped
    and joined as a thread; the thread may change (``hand_over``)."""

    def __init__(self, name: str, state: NodeState) -> None:
        self.name = name
        self._runner = threading.Thread(target=self._run, name=name, daemon=True)
        self._base = 0.0
        self._state = state
        self._cycles: list[Periodic] = []
        self._changed = threading.Condition()
        self._stopped = False
        self._logged: set[tuple[str, str]] = set()
        self.wakeups = 0
        """How many times the clock woke and ran cycles."""
        self.hand_overs = 0
        """How many times a stuck cycle handed the clock to a fresh thread."""

    @property
    def ident(self) -> int | None:
        return self._runner.ident

    def start(self) -> None:
        self._base = time.monotonic()
        self._runner.start()

    def is_alive(self) -> bool:
        return self._runner.is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the clock's current thread (not for one it handed over from)."""
        self._runner.join(timeout)

    def hand_over(self) -> None:
        """Go on on a fresh thread; the current one ends after the cycle it is in."""
        with self._changed:
            if self._stopped:
                return
            self.hand_overs += 1
            self._runner = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._runner.start()
            log.warning("clock %s: a cycle is stuck in a call; its other cycles go on on a "
                        "fresh thread", self.name)

    def every(self, name: str, interval_s: float, fn: Callable[[float, float], None],
              finishes_later: bool = False) -> Periodic:
        """Run ``fn`` every ``interval_s`` (the first time at once); see ``Periodic``."""
        cycle = Periodic(self, name, interval_s, fn, finishes_later)
        with self._changed:
            self._cycles.append(cycle)
            self._changed.notify()
        return cycle

    def wake(self, cycle: Periodic) -> None:
        with self._changed:
            if cycle.woken is None:
                cycle.woken = time.monotonic()
                self._changed.notify()

    def _run(self) -> None:
        me = threading.current_thread()
        base = self._base
        while True:
            with self._changed:
                due = self._wait_due() if self._runner is me else None
                if due is None:
                    return
                for cycle in due:
                    cycle.woken = None  # a wake from now on asks for one more cycle
                self.wakeups += 1
            for cycle in due:
                if self._runner is not me:  # handed over while this thread was stuck
                    return
                cycle.run(self._state, self._logged)
            now = time.monotonic()
            with self._changed:
                if self._runner is not me:
                    return
                for cycle in due:
                    if cycle.tick <= now:  # the next tick of its grid after now
                        cycle.tick = base + (math.floor((now - base) / cycle.interval_s) + 1) \
                            * cycle.interval_s

    def _wait_due(self) -> list[Periodic] | None:
        """The cycles due now, once there are any; None once stopped. Under the lock."""
        while not self._stopped:
            now = time.monotonic()
            due = [c for c in self._cycles if c.due() <= now]
            if due:
                return due
            first = min((c.due() for c in self._cycles), default=None)
            self._changed.wait(None if first is None else first - now)
        return None

    def stop(self) -> None:
        """Finish after the current cycle."""
        with self._changed:
            self._stopped = True
            self._changed.notify()
