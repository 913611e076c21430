"""A device and memory statistics given by the caller, for code the hook cannot read them from."""

from __future__ import annotations

import pytest

from gpumon.client import StepMonitor
from gpumon.client.core.transport import MemoryTransport
from gpumon.wire import HelloRecord, MemoryStats, StepRecord

UUID = "GPU-5e1a0000-0000-4000-8000-000000000003"


def test_given_gpu_is_on_hello_and_every_step() -> None:
    transport = MemoryTransport()
    with StepMonitor(run="sim", transport=transport, rank=3, world=4, gpu=UUID) as mon:
        assert mon.gpu == UUID
        for _ in range(2):
            with mon.step():
                pass
    records = transport.records()
    hellos = [r for r in records if isinstance(r, HelloRecord)]
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert [h.gpu for h in hellos] == [UUID]
    assert [s.gpu for s in steps] == [UUID, UUID]


@pytest.mark.parametrize("gpu", ["", "GPU 0", "x" * 129, -1, 4096, 1.0, True])
def test_invalid_gpu_is_refused(gpu: object) -> None:
    with pytest.raises(ValueError, match="gpu="):
        StepMonitor(run="sim", transport=MemoryTransport(), gpu=gpu)  # type: ignore[arg-type]


def test_given_memory_reaches_the_record_and_bad_entries_are_counted() -> None:
    transport = MemoryTransport()
    with StepMonitor(run="sim", transport=transport, rank=0, world=1) as mon:
        with mon.step(memory={"allocated": 10, "reserved": 30, "peak": 20, "retries": 1,
                              "ooms": 0}):
            pass
        with mon.step(memory={"peak": 5, "reserved": -1, "bogus": 3, "allocated": 2.5}):
            pass
        with mon.step(memory={"peak": "big"}):
            pass
        with mon.step():
            pass
        mon.flush()
        invalid = mon.stats.invalid_fields
    steps = [r for r in transport.records() if isinstance(r, StepRecord)]
    assert [s.mem for s in steps] == [
        MemoryStats(allocated_bytes=10, reserved_bytes=30, peak_bytes=20, alloc_retries=1, ooms=0),
        MemoryStats(peak_bytes=5),
        None,
        None,
    ]
    assert invalid == 4  # reserved -1, bogus, allocated 2.5, peak "big"
