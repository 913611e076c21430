"""The hook's backlog through a long outage: bounded in records, bytes and age, the excess
dropped and counted, never a blocked flush, memory that stops growing, and the rest sent in
order once the agent answers. The outage is a ``MemoryTransport`` refusing with
``no_agent`` (a real absent socket answers the same, tests/client/test_socket_transport.py)
and its 60 s pass on a fake clock."""

from __future__ import annotations

import tracemalloc

from gpumon.client import StepMonitor
from gpumon.client.core.backlog import Backlog
from gpumon.client.core.transport import MemoryTransport
from tests.helpers import steps_of


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Counting(MemoryTransport):
    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0

    def send(self, datagram: bytes) -> str | None:
        self.attempts += 1
        return super().send(datagram)


def monitor(backlog: Backlog, transport: MemoryTransport) -> StepMonitor:
    mon = StepMonitor(run="outage", transport=transport)
    with mon._sender._lock:
        mon._sender.backlog = backlog
    return mon


def test_a_60_s_outage_beyond_the_bound_drops_the_oldest_and_sends_the_rest_in_order() -> None:
    clock = Clock()
    transport = Counting()
    transport.fail_with = "no_agent"
    mon = monitor(Backlog(max_records=100, max_bytes=1 << 20, max_age_s=240, clock=clock), transport)
    for _ in range(60):  # a second each: 10 steps, then a flush
        for _ in range(10):
            with mon.step():
                pass
        before = transport.attempts
        mon.flush()
        assert transport.attempts - before <= 2  # a refused send a flush (and the background one): no waiting
        clock.t += 1.0
        assert mon.stats.backlog_records <= 100
    stats = mon.stats
    assert stats.backlog_records + stats.dropped["no_agent"] == 601  # the hello and 600 steps
    assert stats.records_sent == 0
    transport.fail_with = None
    mon.close()
    sent = [s.step for s in steps_of(transport)]
    assert sent == list(range(600 - len(sent), 600))  # the newest, in order
    assert mon.stats.late_records >= len(sent) - 10
    assert mon.stats.backlog_records == 0


def test_the_byte_bound_holds_whatever_the_record_count() -> None:
    transport = MemoryTransport()
    transport.fail_with = "no_agent"
    mon = monitor(Backlog(max_records=10**6, max_bytes=20_000), transport)
    for _ in range(20):
        for _ in range(50):
            with mon.step(samples=1, tokens=2):
                pass
        mon.flush()
        assert 0 < mon.stats.backlog_bytes <= 20_000
    assert mon.stats.dropped["no_agent"] > 0
    mon.close()


def test_a_step_older_than_the_age_bound_is_dropped_before_the_agent_would_refuse_it() -> None:
    clock = Clock()
    transport = MemoryTransport()
    transport.fail_with = "agent_busy"
    mon = monitor(Backlog(max_age_s=240, clock=clock), transport)
    for _ in range(5):
        with mon.step():
            pass
    mon.flush()
    assert mon.stats.backlog_records == 6
    clock.t += 241
    mon.flush()
    assert mon.stats.backlog_records == 0 and mon.stats.dropped == {"agent_busy": 6}
    mon.close()


def test_memory_stops_growing_at_the_bound() -> None:
    transport = MemoryTransport()
    transport.fail_with = "no_agent"
    mon = monitor(Backlog(max_records=500), transport)

    def outage(steps: int) -> None:
        for _ in range(steps // 100):
            for _ in range(100):
                with mon.step(samples=1):
                    pass
            mon.flush()

    tracemalloc.start()
    try:
        outage(2_000)  # the backlog is full from here on
        full = tracemalloc.get_traced_memory()[0]
        outage(20_000)  # unbounded, these would hold ~4 MB more
        grown = tracemalloc.get_traced_memory()[0] - full
    finally:
        tracemalloc.stop()
    assert mon.stats.backlog_records <= 500
    assert grown < 200_000, grown
    mon.close()
