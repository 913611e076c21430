"""``frozen.maker``: the records it makes are the ones the dataclasses make, and as frozen."""

from __future__ import annotations

import dataclasses

import pytest

from gpumon.collectors.samples import GpuSample
from gpumon.wire.frozen import maker
from gpumon.wire.records import CollectiveOp, CommStats, MemoryStats, StepRecord


def _step_values() -> list[object]:
    comm = CommStats(0.5, 0.75, (CollectiveOp("all_reduce", 1, 2**20, 0.25),), None)
    return ["llm", 3, 7, 1.5, 8, 3, 1.7e9, {"forward": 0.5}, 32, 4096, 1e12, 3, 4242,
            MemoryStats(1, 2, 3, 0, 0), comm, None, ("forward",), 0.01, None]


@pytest.mark.parametrize(("cls", "values"), [
    (StepRecord, _step_values()),
    (MemoryStats, [1, None, 3, 0, None]),
    (CollectiveOp, ["all_gather", 2, 10, 0.5]),
    (GpuSample, [2, 12.5, False] + [None] * (len(dataclasses.fields(GpuSample)) - 3)),
])
def test_made_equals_the_dataclass_own(cls: type, values: list[object]) -> None:
    made = maker(cls)(*values)
    expected = cls(*values)
    assert type(made) is cls
    assert made == expected
    assert [getattr(made, f.name) for f in dataclasses.fields(cls)] == values
    assert repr(made) == repr(expected)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.__setattr__(dataclasses.fields(cls)[0].name, None)


def test_every_field_is_required() -> None:
    with pytest.raises(TypeError):
        maker(MemoryStats)(1, 2, 3, 4)


def test_a_hashable_record_hashes_alike() -> None:
    assert hash(maker(CollectiveOp)("a", 1, 2, 0.5)) == hash(CollectiveOp("a", 1, 2, 0.5))


def test_refuses_what_it_cannot_make_alike() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            assert self.x >= 0

    with pytest.raises(AssertionError):
        maker(Checked)
