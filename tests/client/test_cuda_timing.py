"""The CUDA path, against a fake ``torch.cuda`` (this machine has no GPU).

The fake follows torch's API: ``Event(enable_timing=True)`` with ``record()``, ``query()``
and ``elapsed_time()`` in milliseconds; ``memory_stats_as_nested_dict``;
``reset_peak_memory_stats``; ``get_device_properties(i).uuid``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from gpumon.client import StepMonitor
from gpumon.client.core import cuda_clock
from gpumon.client.core.sender import EVENT_DEADLINE_S
from gpumon.client.core.transport import MemoryTransport
from gpumon.wire import EventRecord, HelloRecord, MemoryStats
from tests.client.conftest import ManualClock
from tests.helpers import steps_of

UUID = "5e0c7dd2-aaaa-bbbb-cccc-0123456789ab"


class FakeCuda:
    """A GPU whose clock the test advances and whose work completes when the test says."""

    def __init__(self) -> None:
        self.gpu_time_s = 0.0
        self.completed = True
        self.events_created = 0
        self.peak_resets = 0
        self.streams_built = 0
        self.recorded_on: list[Any] = []
        self.stats = {"allocated": 1000, "reserved": 4000, "peak": 3000, "retries": 0, "ooms": 0}
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                cuda.events_created += 1
                self.t: float | None = None

            def record(self, stream: Any = None) -> None:
                self.t = cuda.gpu_time_s
                cuda.recorded_on.append(stream)

            def query(self) -> bool:
                return cuda.completed

            def elapsed_time(self, end: Event) -> float:
                assert cuda.completed and self.t is not None and end.t is not None
                return (end.t - self.t) * 1000.0

        class Stream:
            def __init__(self, stream_id: int, device_index: int, device_type: int) -> None:
                cuda.streams_built += 1
                self.key = (stream_id, device_index, device_type)

        self.Event = Event
        self.Stream = Stream

    def memory_stats_as_nested_dict(self, device: int) -> dict[str, Any]:
        s = self.stats
        return {
            "allocated_bytes": {"all": {"current": s["allocated"], "peak": s["peak"]}},
            "reserved_bytes": {"all": {"current": s["reserved"], "peak": s["reserved"]}},
            "num_alloc_retries": s["retries"],
            "num_ooms": s["ooms"],
        }

    def reset_peak_memory_stats(self, device: int) -> None:
        self.peak_resets += 1

    def get_device_properties(self, device: int) -> SimpleNamespace:
        return SimpleNamespace(uuid=UUID)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    # Every step timed on the GPU and reading the allocator: the sampling has tests of its own.
    monkeypatch.setattr(cuda_clock, "detect", lambda reset_peak: cuda_clock.CudaClock(
        fake, 0, reset_peak, memory_interval_s=0.0, device_interval_s=0.0))
    return fake


@pytest.fixture
def transport() -> MemoryTransport:
    return MemoryTransport()


@pytest.fixture
def mon(cuda: FakeCuda, transport: MemoryTransport) -> Iterator[StepMonitor]:
    monitor = StepMonitor(run="gpu", transport=transport)
    yield monitor
    monitor.close()


def gpu_step(mon: StepMonitor, cuda: FakeCuda, host_s: float = 0.1, backward_gpu_s: float = 0.050) -> float:
    """A step whose GPU work takes 30 ms forward and 50 ms backward; the host seconds it
    took, read around it."""
    started = time.perf_counter()
    with mon.step():
        with mon.phase("data"):
            time.sleep(0.002)
        with mon.phase("forward"):
            cuda.gpu_time_s += 0.030
        with mon.phase("backward"):
            cuda.gpu_time_s += backward_gpu_s
        time.sleep(host_s)
    return time.perf_counter() - started


def test_phases_come_from_cuda_events_and_data_from_the_host(
    mon: StepMonitor, cuda: FakeCuda, transport: MemoryTransport
) -> None:
    gpu_step(mon, cuda)
    mon.flush()
    [s] = steps_of(transport)
    assert s.phases_s["forward"] == pytest.approx(0.030)
    assert s.phases_s["backward"] == pytest.approx(0.050)
    assert s.phases_s["data"] >= 0.002  # host clock: the fake GPU clock did not move
    assert s.duration_s >= 0.1  # step duration is host wall time


def test_steps_wait_for_their_events_without_synchronising(
    mon: StepMonitor, cuda: FakeCuda, transport: MemoryTransport
) -> None:
    cuda.completed = False
    gpu_step(mon, cuda, host_s=0)
    gpu_step(mon, cuda, host_s=0)
    mon.flush()
    assert steps_of(transport) == []  # the GPU has not reached the events yet
    cuda.completed = True
    mon.flush()
    steps = steps_of(transport)
    assert [s.step for s in steps] == [0, 1]


def test_gpu_time_longer_than_the_host_window_is_clamped(
    mon: StepMonitor, cuda: FakeCuda, transport: MemoryTransport
) -> None:
    # The CPU ran ahead of the GPU's work: 10 s of it, far beyond any host step here.
    host_s = gpu_step(mon, cuda, host_s=0, backward_gpu_s=10.0)
    mon.flush()
    [s] = steps_of(transport)
    assert s.phases_s["backward"] == s.duration_s <= host_s


def test_a_hung_gpu_still_reports_its_steps_with_host_times(
    mon: StepMonitor, cuda: FakeCuda, transport: MemoryTransport
) -> None:
    cuda.completed = False
    host_s = gpu_step(mon, cuda, host_s=0.01)
    time.sleep(EVENT_DEADLINE_S + 0.1)
    mon.flush()
    [s] = steps_of(transport)
    # The host's view: the phases as long as launching their work took, within the step.
    assert not s.device_phases
    assert s.phases_s["forward"] + s.phases_s["backward"] <= s.duration_s <= host_s


def test_memory_statistics_and_peak_reset_per_step(
    mon: StepMonitor, cuda: FakeCuda, transport: MemoryTransport
) -> None:
    gpu_step(mon, cuda, host_s=0)
    cuda.stats.update(peak=3500, retries=2)
    gpu_step(mon, cuda, host_s=0)
    mon.flush()
    first, second = steps_of(transport)
    assert first.mem == MemoryStats(1000, 4000, 3000, 0, 0)
    assert second.mem == MemoryStats(1000, 4000, 3500, 2, 0)
    assert cuda.peak_resets == 2


def test_peak_reset_can_be_turned_off(cuda: FakeCuda, transport: MemoryTransport) -> None:
    with StepMonitor(run="gpu", transport=transport, reset_peak_memory=False) as mon:
        gpu_step(mon, cuda, host_s=0)
    assert cuda.peak_resets == 0
    assert steps_of(transport)[0].mem is not None


def test_device_uuid_is_reported_in_nvml_form(
    mon: StepMonitor, cuda: FakeCuda, transport: MemoryTransport
) -> None:
    gpu_step(mon, cuda, host_s=0)
    mon.flush()
    hello = transport.records()[0]
    assert isinstance(hello, HelloRecord) and hello.gpu == f"GPU-{UUID}"
    assert steps_of(transport)[0].gpu == f"GPU-{UUID}"
    assert mon.gpu == f"GPU-{UUID}"


def test_events_are_reused_once_read(mon: StepMonitor, cuda: FakeCuda) -> None:
    for _ in range(20):
        gpu_step(mon, cuda, host_s=0)
        mon.flush()
    assert cuda.events_created <= 6  # 3 per step (2 adjacent GPU phases), reused after each flush
    pool = mon._cuda._pool  # type: ignore[union-attr]
    assert len({id(e) for e in pool}) == len(pool)  # a shared boundary went back once


def three_phases(mon: StepMonitor, cuda: FakeCuda) -> None:
    with mon.step():
        for name, gpu_s in (("forward", 0.030), ("backward", 0.050), ("optimizer", 0.010)):
            with mon.phase(name):
                cuda.gpu_time_s += gpu_s
        time.sleep(0.1)  # the host waits for the GPU (else its window clamps the GPU times)


def test_adjacent_phases_share_a_boundary_event(
    mon: StepMonitor, cuda: FakeCuda, transport: MemoryTransport
) -> None:
    # Wide enough for any machine here (the default is 10 µs): adjacent phases always share.
    mon._cuda.share_gap_s = 3600.0  # type: ignore[union-attr]
    three_phases(mon, cuda)
    assert len(cuda.recorded_on) == 4  # one start, three ends: not six
    mon._cuda.share_gap_s = 0.005  # type: ignore[union-attr]  # the 20 ms below exceed it
    with mon.step():
        with mon.phase("forward"):
            cuda.gpu_time_s += 0.030
        time.sleep(0.02)  # host work between the phases (could launch kernels): no sharing
        with mon.phase("backward"):
            cuda.gpu_time_s += 0.050
        time.sleep(0.1)
    assert len(cuda.recorded_on) == 8
    mon.flush()
    first, second = steps_of(transport)
    assert first.phases_s == pytest.approx({"forward": 0.030, "backward": 0.050, "optimizer": 0.010})
    assert second.phases_s == pytest.approx({"forward": 0.030, "backward": 0.050})


def test_sharing_can_be_turned_off(mon: StepMonitor, cuda: FakeCuda, transport: MemoryTransport) -> None:
    mon._cuda.share_gap_s = 0.0  # type: ignore[union-attr]
    three_phases(mon, cuda)
    assert len(cuda.recorded_on) == 6
    mon.flush()
    assert steps_of(transport)[0].phases_s == pytest.approx(
        {"forward": 0.030, "backward": 0.050, "optimizer": 0.010}
    )


def test_events_record_on_a_kept_stream_object(transport: MemoryTransport) -> None:
    fake = FakeCuda()
    current = [(7, 0, 1)]
    calls = []

    def current_stream(device: int) -> tuple[int, int, int]:
        calls.append(device)
        if current[0] is None:
            raise RuntimeError("CUDA error")
        return current[0]

    clock = cuda_clock.CudaClock(fake, 0, True, current_stream=current_stream)
    events = [clock.event() for _ in range(5)]
    assert fake.streams_built == 1 and len(calls) == 5
    assert all(stream is fake.recorded_on[0] for stream in fake.recorded_on)
    assert fake.recorded_on[0].key == (7, 0, 1)
    current[0] = (9, 0, 1)  # `with torch.cuda.stream(s):` made another stream current
    clock.event()
    assert fake.streams_built == 2 and fake.recorded_on[-1].key == (9, 0, 1)
    current[0] = None  # the private call failed: record() finds the stream itself from now on
    clock.event()
    clock.event()
    assert fake.recorded_on[-2:] == [None, None] and len(calls) == 7
    assert len(events) == 5


def test_allocator_statistics_are_read_at_most_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    now = ManualClock().install(monkeypatch, "gpumon.client.core.cuda_clock")
    fake = FakeCuda()
    clock = cuda_clock.CudaClock(fake, 0, True, memory_interval_s=0.05)
    readings = []
    for _ in range(10):
        readings.append(clock.memory())
        now.advance(0.004)  # the readings span 36 ms: inside the interval
    assert readings[0] is not None and readings[1:] == [None] * 9
    assert fake.peak_resets == 1
    now.advance(0.014)  # 54 ms after the first reading: past it
    assert clock.memory() is not None and fake.peak_resets == 2
    assert clock.read_memory() is not None  # at close: read now, whatever the interval


def test_oom_that_ends_an_open_step_is_reported_at_close(cuda: FakeCuda, transport: MemoryTransport) -> None:
    mon = StepMonitor(run="gpu", transport=transport)
    gpu_step(mon, cuda, host_s=0)
    step = mon.step()
    step.__enter__()  # a framework opened a step and the OOM escaped past its hooks
    cuda.stats["ooms"] = 1
    mon.close()
    events = [r for r in transport.records() if isinstance(r, EventRecord)]
    assert [(e.event, e.step) for e in events] == [("oom", 1)]


def test_no_cuda_on_this_machine_means_host_clocks() -> None:
    import torch

    assert not torch.cuda.is_available()
    assert cuda_clock.detect(True) is None


def test_cuda_first_used_after_start_gets_a_second_hello(
    monkeypatch: pytest.MonkeyPatch, transport: MemoryTransport
) -> None:
    fake = FakeCuda()
    clocks = iter([None, cuda_clock.CudaClock(fake, 0, True)])  # at construction, at the first step
    monkeypatch.setattr(cuda_clock, "detect", lambda reset_peak: next(clocks))
    with StepMonitor(run="late-cuda", transport=transport) as mon:
        gpu_step(mon, fake, host_s=0)
    hellos = [r for r in transport.records() if isinstance(r, HelloRecord)]
    assert [h.gpu for h in hellos] == [None, f"GPU-{UUID}"]
    assert steps_of(transport)[0].mem is not None
