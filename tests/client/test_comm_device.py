"""Collectives on a GPU, timed by CUDA events: the ledger's ``DeviceComm`` and the sender
holding a step's record until the GPU has passed them.

No GPU runs here, so the GPU is a stand-in (``FakeGpu``): its events carry the GPU time the
test sets before recording them, and count as passed once the test moves the GPU past them.
What it stands in for is ``CudaClock`` (``event``, ``passed``, ``elapsed_s``, ``release``);
the NCCL path through DDP's hook runs for real in ``benchmarks/gpu_checks/ddp.py`` on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from gpumon.client import StepMonitor
from gpumon.client.comm.device import DeviceComm
from gpumon.client.comm.ledger import CommLedger
from gpumon.client.core.transport import MemoryTransport
from gpumon.wire import CollectiveOp
from tests.client.conftest import ManualClock
from tests.helpers import steps_of

MIB = 1 << 20


class FakeEvent:
    def __init__(self, t: float) -> None:
        self.t = t


class FakeGpu:
    """A GPU stand-in (module docstring)."""

    def __init__(self) -> None:
        self.time = 0.0  # the GPU time the next event is recorded at
        self.reached = -1.0  # events at or before this time have passed
        self.recorded: list[FakeEvent] = []
        self.released: list[FakeEvent] = []
        self.broken = False  # recording raises, as after a CUDA error

    def at(self, t: float) -> FakeGpu:
        self.time = t
        return self

    def event(self) -> FakeEvent:
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        event = FakeEvent(self.time)
        self.recorded.append(event)
        return event

    def passed(self, event: FakeEvent) -> bool:
        return event.t <= self.reached

    def elapsed_s(self, start: FakeEvent, end: FakeEvent) -> float:
        return end.t - start.t

    def release(self, event: FakeEvent) -> None:
        self.released.append(event)


def ddp_step(ledger: CommLedger, gpu: FakeGpu, launches: list[tuple[float, float]],
             wait: tuple[float, float], nbytes: int = 16 * MIB) -> None:
    """What DDP's hook does on a GPU, with the GPU times each event lands at: one all-reduce
    per (launch, completion), then the wait at the end of backward (start, end)."""
    for launch, completion in launches:
        op = ledger.launched("all_reduce", nbytes, 0.0, 0.0, False, device_start=gpu.at(launch).event())
        assert op is not None
        gpu.at(completion)
        op.device_done(gpu)
    tail = ledger.wait_from(0.0, mirrored=True)
    assert tail is not None
    gpu.at(wait[0])
    tail.waiting()
    gpu.at(wait[1])
    tail.resumed()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    """The ledger's host clock, moved by the test."""
    return ManualClock().install(monkeypatch, "gpumon.client.comm.ledger").install(
        monkeypatch, "gpumon.client.comm.ops")


def test_exposed_is_the_streams_wait_and_busy_the_union_of_the_collectives(clock: ManualClock) -> None:
    gpu = FakeGpu()
    ledger = CommLedger(device_clock=lambda: gpu)
    ledger.step_begin()
    # Buckets launched at 10 and 20 ms end at 30 and 50 ms; backward's last kernel ends at
    # 45 ms, the stream resumes at 60 ms (the copy back into the gradients: 50-60 ms).
    ddp_step(ledger, gpu, [(0.010, 0.030), (0.020, 0.050)], (0.045, 0.060))
    clock.advance(0.07)  # the host's step lasts as long as the GPU's: no figure bounded by it
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    comm = fields["comm"]
    assert isinstance(comm, DeviceComm)
    assert not comm.ready()
    gpu.reached = 0.059
    assert not comm.ready()  # the resume event is not passed yet
    gpu.reached = 0.060
    assert comm.ready()
    value = comm.value()
    assert value is not None
    # exposed: the wait (15 ms) and the copy into the buckets, the same bytes as the copy
    # back (10 ms); busy: the collectives' union with the wait (10-60 ms) and that copy.
    assert value["exposed"] == pytest.approx(0.025)
    assert value["busy"] == pytest.approx(0.060)
    assert value["ops"] == {"all_reduce": [2, 32 * MIB, pytest.approx(0.050)]}
    assert len(gpu.released) == len(gpu.recorded) == 6  # every event goes back once
    assert ledger.steps_measured == 1 and ledger.steps_not_timed == 0


def test_figures_are_bounded_by_the_steps_duration(clock: ManualClock) -> None:
    gpu = FakeGpu()
    ledger = CommLedger(device_clock=lambda: gpu)
    ledger.step_begin()  # the host step lasts a millisecond; the GPU figures are far longer
    ddp_step(ledger, gpu, [(0.0, 2.0)], (1.0, 3.0))
    clock.advance(0.001)
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    comm = fields["comm"]
    assert isinstance(comm, DeviceComm)
    gpu.reached = 10.0
    value = comm.value()
    assert value is not None
    assert value["exposed"] == value["busy"] == pytest.approx(0.001)


def test_a_step_mixing_gpu_and_host_collectives_is_not_measured() -> None:
    gpu = FakeGpu()
    ledger = CommLedger(device_clock=lambda: gpu)
    ledger.step_begin()
    host = ledger.launched("barrier", 0, 0.0, 0.0, True)
    assert host is not None
    host.done()
    ddp_step(ledger, gpu, [(0.01, 0.02)], (0.02, 0.03))
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    assert "comm" not in fields
    assert ledger.steps_not_timed == 1


def test_a_gpu_collective_without_events_leaves_the_step_unmeasured() -> None:
    ledger = CommLedger(device_clock=lambda: None)  # no CUDA clock: events cannot be recorded
    ledger.step_begin()
    ledger.launched("all_reduce", MIB, 0.0, 0.0, False)
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    assert "comm" not in fields and ledger.steps_not_timed == 1


def test_gpu_collectives_without_a_wait_to_read_are_not_measured() -> None:
    # FSDP on a GPU: its collectives are timed but no watcher sees the stream wait on them.
    gpu = FakeGpu()
    ledger = CommLedger(device_clock=lambda: gpu)
    ledger.step_begin()
    op = ledger.launched("all_gather", MIB, 0.0, 0.0, False, device_start=gpu.at(0.01).event())
    assert op is not None
    op.device_done(gpu.at(0.02))
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    assert "comm" not in fields and ledger.steps_not_timed == 1


@pytest.fixture
def gpu_monitor() -> Iterator[tuple[StepMonitor, MemoryTransport, FakeGpu, CommLedger]]:
    transport = MemoryTransport()
    mon = StepMonitor(run="device-comm", transport=transport, rank=0, world=2)
    gpu = FakeGpu()
    ledger = mon.extensions.attach(CommLedger, lambda: CommLedger(device_clock=lambda: gpu))
    yield mon, transport, gpu, ledger
    mon.close()


def test_the_record_waits_for_the_gpu_and_then_carries_the_figures(
        gpu_monitor: tuple[StepMonitor, MemoryTransport, FakeGpu, CommLedger]) -> None:
    mon, transport, gpu, ledger = gpu_monitor
    for step in range(2):
        with mon.step(samples=8):
            time.sleep(0.05)  # as long as the GPU's step, so no figure is bounded by it
            base = step * 0.1
            ddp_step(ledger, gpu, [(base + 0.01, base + 0.03)], (base + 0.02, base + 0.04))
    mon.flush()
    assert steps_of(transport) == []  # the GPU has passed none of the events
    gpu.reached = 0.05  # past the first step's, not the second's
    mon.flush()
    first = steps_of(transport)
    assert [s.step for s in first] == [0]
    assert first[0].comm is not None
    assert first[0].comm.exposed_s == pytest.approx(0.03)  # 20-40 ms, and 30-40 ms copied in
    assert first[0].comm.busy_s == pytest.approx(0.04)  # 10-40 ms, and the copy
    assert first[0].comm.ops == (CollectiveOp("all_reduce", 1, 16 * MIB, pytest.approx(0.02)),)
    gpu.reached = 1.0
    mon.flush()
    assert [s.step for s in steps_of(transport)] == [0, 1]
    assert mon.stats.gpu_fields_missed == 0


def test_a_gpu_that_never_gets_there_costs_the_field_not_the_record(
        gpu_monitor: tuple[StepMonitor, MemoryTransport, FakeGpu, CommLedger]) -> None:
    mon, transport, gpu, ledger = gpu_monitor
    with mon.step(samples=8):
        with mon.phase("forward"):
            ddp_step(ledger, gpu, [(0.01, 0.03)], (0.02, 0.04))
    mon.flush()
    assert steps_of(transport) == []
    mon.close()  # waits briefly, then sends what it has
    steps = steps_of(transport)
    assert [s.step for s in steps] == [0]
    assert steps[0].comm is None and steps[0].samples == 8 and "forward" in steps[0].phases_s
    assert mon.stats.gpu_fields_missed == 1
    assert gpu.released == []  # nothing the GPU may still write is handed out again


def test_events_that_cannot_be_recorded_cost_the_field_never_the_step(
        gpu_monitor: tuple[StepMonitor, MemoryTransport, FakeGpu, CommLedger]) -> None:
    mon, transport, gpu, ledger = gpu_monitor
    with mon.step(samples=8):
        gpu.broken = True  # from the completion on: inside a future's callback on a GPU
        op = ledger.launched("all_reduce", MIB, 0.0, 0.0, False, device_start=FakeEvent(0.0))
        assert op is not None
        op.device_done(gpu)  # must not raise into the collective's callback
        tail = ledger.wait_from(0.0)
        assert tail is not None
        tail.waiting()
        tail.resumed()  # nor into autograd's
    mon.flush()  # ready at once: nothing to wait for
    steps = steps_of(transport)
    assert [s.step for s in steps] == [0] and steps[0].comm is None and steps[0].samples == 8
    assert mon.stats.gpu_fields_missed == 1


def test_a_completion_recorded_after_the_step_ended_is_waited_for(clock: ManualClock) -> None:
    # A collective's completion callback may run after its step has ended (on the thread
    # that completes the work): the step's figures wait for it, then carry it.
    gpu = FakeGpu()
    ledger = CommLedger(device_clock=lambda: gpu)
    ledger.step_begin()
    op = ledger.launched("all_reduce", MIB, 0.0, 0.0, False, device_start=gpu.at(0.010).event())
    assert op is not None
    tail = ledger.wait_from(0.0)
    assert tail is not None
    tail.waiting()
    tail.resumed()
    clock.advance(0.05)
    fields: dict[str, object] = {}
    ledger.step_end(fields)
    comm = fields["comm"]
    assert isinstance(comm, DeviceComm)
    gpu.reached = 1.0
    assert not comm.ready()  # the completion is not recorded yet
    op.device_done(gpu.at(0.030))
    assert comm.ready()
    value = comm.value()
    assert value is not None and value["ops"] == {"all_reduce": [1, MIB, pytest.approx(0.020)]}
