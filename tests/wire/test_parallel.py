"""A hello's parallel layout and a step's bubble on the wire: what round-trips, what is refused
and with which reason."""

from __future__ import annotations

import json

import pytest

from gpumon.wire import (
    CommStats,
    HelloRecord,
    ParallelLayout,
    StepRecord,
    decode_datagram,
    encode_record,
)


def test_a_layout_round_trips() -> None:
    layout = ParallelLayout(dp=3, tp=1, pp=0, source="mesh", other=(("replica", 1),))
    hello = HelloRecord("job", 5, 16, parallel=layout)
    decoded = decode_datagram(encode_record(hello))
    assert decoded.records == [hello]


def test_a_hello_without_a_layout_stays_valid() -> None:
    hello = HelloRecord("job", 0, 2)
    assert "parallel" not in json.loads(encode_record(hello))
    assert decode_datagram(encode_record(hello)).records == [hello]


def test_the_bubble_round_trips_and_is_optional() -> None:
    comm = CommStats(0.4, 0.5, (), bubble_s=0.3)
    step = StepRecord("job", 0, 1, 1.0, comm=comm)
    assert decode_datagram(encode_record(step)).records == [step]
    plain = StepRecord("job", 0, 1, 1.0, comm=CommStats(0.4, 0.5))
    assert decode_datagram(encode_record(plain)).records == [plain]


@pytest.mark.parametrize("parallel", [
    {"pp": -1},
    {"tp": 1.5},
    {"dp": "0"},
    {"dp": 1 << 20},
    {"xx": 0},
    {"source": "a b"},
    {"other": {"bad name": 1}},
    {"other": {f"d{i}": 0 for i in range(9)}},
    {"other": [1]},
    [0, 1],
])
def test_a_bad_layout_drops_the_hello_as_bad_parallel(parallel: object) -> None:
    datagram = json.dumps({"v": 1, "kind": "hello", "run": "job", "rank": 0,
                           "parallel": parallel}).encode()
    assert decode_datagram(datagram).rejected == ["bad_parallel"]


@pytest.mark.parametrize("bubble", [-0.1, 2.0, "0.1"])
def test_a_bubble_outside_its_step_drops_the_step_as_bad_comm(bubble: object) -> None:
    datagram = json.dumps({"v": 1, "kind": "step", "run": "job", "rank": 0, "step": 1,
                           "duration": 1.0,
                           "comm": {"exposed": 0.5, "busy": 0.5, "bubble": bubble}}).encode()
    assert decode_datagram(datagram).rejected == ["bad_comm"]
