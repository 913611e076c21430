"""StepMonitor's records, through the in-memory transport: steps, phases, data wait, errors."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from gpumon.client import ClientStats, StepMonitor
from gpumon.client.core.transport import MemoryTransport
from gpumon.client.integrations.wrap import wrap_step
from gpumon.client.monitor import BUFFER_STEPS
from gpumon.wire import MAX_PHASES, EventRecord, HelloRecord
from tests.helpers import steps_of


@pytest.fixture
def transport() -> MemoryTransport:
    return MemoryTransport()


@pytest.fixture
def mon(transport: MemoryTransport) -> Iterator[StepMonitor]:
    monitor = StepMonitor(run="unit", transport=transport, rank=0, world=2, local_rank=0)
    yield monitor
    monitor.close()


def events_of(transport: MemoryTransport) -> list[EventRecord]:
    return [r for r in transport.records() if isinstance(r, EventRecord)]


def test_steps_carry_phases_counts_and_identity(mon: StepMonitor, transport: MemoryTransport) -> None:
    for _ in range(3):
        with mon.step(samples=8, tokens=1024, flops=5e9):
            with mon.phase("forward"):
                time.sleep(0.002)
            with mon.phase("backward"):
                time.sleep(0.003)
            with mon.phase("optimizer"):
                pass
    mon.flush()
    records = transport.records()
    hello = records[0]
    assert isinstance(hello, HelloRecord)
    assert (hello.run, hello.rank, hello.world, hello.client_version) == ("unit", 0, 2, "0.1.0")
    steps = steps_of(transport)
    assert [s.step for s in steps] == [0, 1, 2]
    for s in steps:
        assert (s.run, s.rank, s.world, s.local_rank) == ("unit", 0, 2, 0)
        assert (s.samples, s.tokens, s.flops) == (8, 1024, 5e9)
        assert set(s.phases_s) == {"forward", "backward", "optimizer"}
        assert 0.002 <= s.phases_s["forward"] < s.duration_s
        assert 0.003 <= s.phases_s["backward"] < s.duration_s
        assert s.duration_s >= 0.005
        assert s.pid is not None and s.mem is None and s.gpu is None
        assert s.t_start is not None and abs(s.t_start - time.time()) < 60
    assert steps[1].t_start >= steps[0].t_start + steps[0].duration_s  # type: ignore[operator]


def test_loader_wait_is_the_next_steps_data_phase(mon: StepMonitor, transport: MemoryTransport) -> None:
    def slow_batches() -> Iterator[int]:
        for i in range(3):
            time.sleep(0.01)
            yield i

    consumed = []
    for batch in mon.loader(slow_batches()):
        consumed.append(batch)
        with mon.step(samples=1):
            with mon.phase("forward"):
                time.sleep(0.001)
    mon.flush()
    assert consumed == [0, 1, 2]
    steps = steps_of(transport)
    assert len(steps) == 3
    for s in steps:
        assert 0.01 <= s.phases_s["data"] <= s.duration_s
        # The step's window starts when the batch was asked for.
        assert s.duration_s >= s.phases_s["data"] + s.phases_s["forward"]


def test_nested_phases_count_only_the_outermost(mon: StepMonitor, transport: MemoryTransport) -> None:
    with mon.step():
        with mon.phase("forward"):
            with mon.phase("comm"):
                time.sleep(0.002)
            with mon.phase("forward"):
                pass
    mon.flush()
    [s] = steps_of(transport)
    assert set(s.phases_s) == {"forward"}
    assert s.phases_s["forward"] >= 0.002


def test_nested_steps_count_as_one(mon: StepMonitor, transport: MemoryTransport) -> None:
    with mon.step(samples=4), mon.step(samples=99):
        pass
    mon.flush()
    assert [s.samples for s in steps_of(transport)] == [4]


def test_phase_outside_a_step_belongs_to_the_next_step(mon: StepMonitor, transport: MemoryTransport) -> None:
    with mon.phase("eval"):
        time.sleep(0.003)
    with mon.step():
        pass
    mon.flush()
    [s] = steps_of(transport)
    assert s.phases_s["eval"] >= 0.003 and s.duration_s >= s.phases_s["eval"]


def test_free_form_and_repeated_phases_add_up(mon: StepMonitor, transport: MemoryTransport) -> None:
    with mon.step():
        for _ in range(3):
            with mon.phase("comm"):
                time.sleep(0.001)
        with mon.phase("my.custom/phase-1"):
            pass
    mon.flush()
    [s] = steps_of(transport)
    assert s.phases_s["comm"] >= 0.003
    assert "my.custom/phase-1" in s.phases_s


def test_invalid_phase_name_is_a_clear_error(mon: StepMonitor) -> None:
    with pytest.raises(ValueError, match="phase name 'data load'"):
        mon.phase("data load")


def test_too_many_phases_fold_into_other(mon: StepMonitor, transport: MemoryTransport) -> None:
    with mon.step():
        for i in range(MAX_PHASES + 5):
            with mon.phase(f"p{i}"):
                pass
    mon.flush()
    [s] = steps_of(transport)
    assert len(s.phases_s) == MAX_PHASES and "other" in s.phases_s


def test_caller_step_numbers_are_reported(mon: StepMonitor, transport: MemoryTransport) -> None:
    for n in (100, 101):
        with mon.step(step=n):
            pass
    mon.flush()
    assert [s.step for s in steps_of(transport)] == [100, 101]


def test_unusable_counts_are_omitted_and_counted(mon: StepMonitor, transport: MemoryTransport) -> None:
    with mon.step(samples=torch.tensor(3), tokens=-1, flops=float("nan")):  # type: ignore[arg-type]
        pass
    with mon.step(step=-5):
        pass
    mon.flush()
    first, second = steps_of(transport)
    assert (first.samples, first.tokens, first.flops) == (None, None, None)
    assert second.step == 1
    assert mon.stats.invalid_fields == 4


def test_other_exceptions_propagate_unchanged_and_drop_the_step(
    mon: StepMonitor, transport: MemoryTransport
) -> None:
    error = KeyError("boom")
    with pytest.raises(KeyError) as caught:
        with mon.step():
            with mon.phase("forward"):
                raise error
    assert caught.value is error
    with mon.step():
        with mon.phase("backward"):
            pass
    mon.flush()
    [s] = steps_of(transport)
    assert set(s.phases_s) == {"backward"}  # the failed step's phases are not carried over
    assert events_of(transport) == []


def test_out_of_memory_is_reported_and_reraised_unchanged(
    mon: StepMonitor, transport: MemoryTransport
) -> None:
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    with mon.step():
        pass
    with pytest.raises(torch.OutOfMemoryError) as caught:
        with mon.step(), mon.phase("forward"):
            raise error
    assert caught.value is error
    mon.flush()
    [event] = events_of(transport)
    assert (event.event, event.run, event.rank, event.step) == ("oom", "unit", 0, 1)
    assert event.message is not None and "Tried to allocate 20.00 GiB" in event.message
    assert len(steps_of(transport)) == 1


def test_buffer_overflow_drops_oldest_and_counts(transport: MemoryTransport) -> None:
    mon = StepMonitor(run="unit", transport=transport)
    extra = 100
    with mon._sender._lock:  # the sender is stuck: the training loop goes on regardless
        for _ in range(BUFFER_STEPS + extra):
            with mon.step():
                pass
    mon.flush()
    steps = steps_of(transport)
    assert len(steps) == BUFFER_STEPS
    assert steps[0].step == extra  # the newest steps are kept
    assert mon.stats.dropped == {"buffer_full": extra}


def test_failed_sends_are_counted_by_reason_and_never_raise(transport: MemoryTransport) -> None:
    transport.fail_with = "agent_busy"
    mon = StepMonitor(run="unit", transport=transport)
    for _ in range(10):
        with mon.step():
            pass
    mon.close()
    stats = mon.stats
    # ten steps, the hello and the close's word that the process finished
    assert stats == ClientStats(steps=10, records_sent=0, datagrams_sent=0, dropped={"agent_busy": 12})


def test_a_raising_transport_costs_records_not_the_run() -> None:
    class Broken:
        def send(self, datagram: bytes) -> str | None:
            raise RuntimeError("broken transport")

        def close(self) -> None:
            pass

    mon = StepMonitor(run="unit", transport=Broken())
    with mon.step():
        pass
    mon.close()
    assert mon.stats.dropped == {"send_error": 3}  # the hello, the step, the finish


def test_background_thread_sends_without_flush_or_close(mon: StepMonitor, transport: MemoryTransport) -> None:
    with mon.step():
        pass
    deadline = time.monotonic() + 2
    while not steps_of(transport) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(steps_of(transport)) == 1


def test_close_is_final_and_idempotent(transport: MemoryTransport) -> None:
    with StepMonitor(run="unit", transport=transport) as mon:
        with mon.step():
            pass
    assert transport.closed
    mon.close()
    with mon.step():  # after close: a no-op, not an error
        pass
    assert len(steps_of(transport)) == 1


def test_wrap_step_times_each_call(mon: StepMonitor, transport: MemoryTransport) -> None:
    def train_step(batch: list[int], scale: int = 1) -> int:
        return sum(batch) * scale

    step = wrap_step(mon, train_step, samples=lambda batch, **_: len(batch), flops=1e6)
    assert step([1, 2, 3], scale=2) == 12
    assert step([4]) == 4
    assert step.__name__ == "train_step"
    mon.flush()
    assert [(s.samples, s.flops) for s in steps_of(transport)] == [(3, 1e6), (1, 1e6)]


def test_numbers_of_every_kind_become_valid_records(mon: StepMonitor, transport: MemoryTransport) -> None:
    import numpy as np

    with mon.step(samples=np.int64(7), tokens=2**62, flops=10**20):
        with mon.phase("forward"):
            pass  # a phase of well under a microsecond
    with mon.step(samples=3.5, tokens=True, flops=np.float64(2.5e12)):  # type: ignore[arg-type]
        pass
    mon.flush()
    first, second = steps_of(transport)
    assert (first.samples, first.tokens, first.flops) == (7, 2**62, 1e20)
    assert 0 <= first.phases_s["forward"] < 1e-3
    assert (second.samples, second.tokens, second.flops) == (None, None, 2.5e12)
    assert mon.stats.invalid_fields == 2
    assert mon.stats.dropped == {}


def test_a_long_flush_lets_go_of_the_gil_every_few_records(transport: MemoryTransport,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumon.client.core import sender

    slept: list[float] = []

    class Clock:  # the sender's ``time``, noting each sleep: how it lets go of the GIL
        def __getattr__(self, name: str) -> object:
            return getattr(time, name)

        def sleep(self, seconds: float) -> None:
            slept.append(seconds)

    mon = StepMonitor(run="unit", transport=transport)
    steps = 5 * sender.GIL_YIELD_RECORDS + 3
    with mon._sender._lock:  # no background flush meanwhile
        for _ in range(steps):
            with mon.step():
                pass
    monkeypatch.setattr(sender, "time", Clock())
    mon.flush()
    assert len(steps_of(transport)) == steps
    assert slept == [0] * 5  # one every GIL_YIELD_RECORDS records encoded, the hello among them
    mon.close()
