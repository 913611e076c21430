"""The agent's collection schedule: each collector on its own thread, timed, errors counted.

One thread per collector keeps a slow or hung source (an NVML call that does not return)
from delaying the others or a scrape. Each cycle's start, duration and success are written
to the collector's stats in the node state, where ``/readyz`` sees a cycle that is stuck and
``gpumon_collector_duration_seconds`` reports how long the last one took.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpumon.state.node import NodeState

log = logging.getLogger(__name__)


WAKE_COALESCE_S = 0.2
"""After a wake, how long the thread waits for others to join it: a burst of wakes (a job's
ranks starting together) is one cycle, not one each."""


class Periodic(threading.Thread):
    """Runs ``fn(now, monotonic)`` every ``interval_s`` on its own thread, timing it and
    counting its errors by kind. ``wake()`` brings the next cycle forward.

    A cycle that goes on after ``fn`` returns, on threads of its own (``finishes_later``:
    NVML's pollers hand their samples on as they come), is timed, and its success marked, by
    whoever ends it; here only its start, errors and a stuck call are seen."""

    def __init__(self, name: str, interval_s: float, fn: Callable[[float, float], None],
                 state: NodeState, finishes_later: bool = False) -> None:
        super().__init__(name=f"gpumon-{name}", daemon=True)
        self.collector = name
        self.finishes_later = finishes_later
        self._interval_s = interval_s
        self._fn = fn
        self._state = state
        self._stop_event = threading.Event()
        self._wake_event = threading.Event()
        self._logged: set[str] = set()

    def run(self) -> None:
        stats = self._state.collector(self.collector, self._interval_s)
        next_tick = time.monotonic()
        while not self._stop_event.is_set():
            started = time.monotonic()
            stats.running_since_monotonic = started
            stats.last_attempt_t = time.time()
            try:
                self._fn(stats.last_attempt_t, started)
            except Exception as exc:  # a collector failure must never stop the agent
                # An error may name its kind (``kind``); else its class does.
                kind = getattr(exc, "kind", None) or type(exc).__name__
                self._state.count_error(self.collector, kind.lower())
                if kind not in self._logged:
                    self._logged.add(kind)
                    log.exception("collector %s failed (further %s errors are only counted)",
                                  self.collector, kind)
            else:
                if not self.finishes_later:
                    stats.last_success_t = stats.last_attempt_t
            finally:
                stats.running_since_monotonic = None
                if not self.finishes_later:
                    stats.last_duration_s = time.monotonic() - started
            next_tick += self._interval_s
            delay = next_tick - time.monotonic()
            if delay < 0:  # overran: skip missed ticks instead of bursting
                next_tick = time.monotonic()
                delay = 0.0
            if self._wake_event.wait(delay) and not self._stop_event.is_set():
                self._stop_event.wait(WAKE_COALESCE_S)
                self._wake_event.clear()
                next_tick = time.monotonic()  # the schedule starts again from the woken cycle

    def wake(self) -> None:
        """Run the next cycle now (within ``WAKE_COALESCE_S``) rather than at its tick; wakes
        during a cycle bring one more cycle right after it. Never blocks."""
        self._wake_event.set()

    def stop(self) -> None:
        """Finish after the current cycle."""
        self._stop_event.set()
        self._wake_event.set()
