"""The step's ``moe`` field: what travels, its limits, and what the agent drops (``bad_moe``)."""

from __future__ import annotations

import json

import pytest

from gpumon.wire import (
    MAX_DATAGRAM_BYTES,
    MAX_EXPERTS,
    MAX_MOE_LAYERS,
    ExpertLoad,
    MoeStats,
    ProtocolError,
    StepRecord,
    decode_datagram,
    encode_measured_field,
    encode_record,
)


def _step(moe: object, step: int = 1) -> dict[str, object]:
    return {"v": 1, "kind": "step", "run": "moe", "rank": 0, "step": step, "duration": 0.5, "moe": moe}


def _decode(*objects: dict[str, object]):
    return decode_datagram(json.dumps(list(objects)).encode())


GOOD = {"window": 50, "layers": {"0": [8, 800, 2.5, 0.75, 1], "1": [8, 800, 1.0, 0.0, 0]}}


def test_round_trip() -> None:
    record = StepRecord("moe", 0, 1, 0.5, moe=MoeStats(50, (ExpertLoad("0", 8, 800, 2.5, 0.75, 1),
                                                             ExpertLoad("layers.1", 4, 40, 1.0, 0.0, 0))))
    result = decode_datagram(encode_record(record))
    assert result.rejected == []
    assert result.records == [record]


def test_decoded_from_wire() -> None:
    result = _decode(_step(GOOD))
    moe = result.records[0].moe
    assert moe.window == 50
    assert moe.layers[0] == ExpertLoad("0", 8, 800, 2.5, 0.75, 1)


def test_a_record_without_it_stays_valid() -> None:
    obj = _step(None)
    del obj["moe"]
    assert _decode(obj).records[0].moe is None


@pytest.mark.parametrize("moe", [
    [],  # not an object
    {"window": 50},  # no layers
    {"window": 50, "layers": {}},
    {"window": 0, "layers": GOOD["layers"]},  # a window of no step
    {"window": 10_001, "layers": GOOD["layers"]},
    {"window": 50, "layers": GOOD["layers"], "counts": [1, 2]},  # unknown key
    {"window": 50, "layers": {"bad name": [8, 800, 2.5, 0.75, 1]}},
    {"window": 50, "layers": {"x" * 33: [8, 800, 2.5, 0.75, 1]}},
    {"window": 50, "layers": {"0": [8, 800, 2.5, 0.75]}},  # four figures
    {"window": 50, "layers": {"0": [0, 800, 1.0, 0.0, 0]}},  # no expert
    {"window": 50, "layers": {"0": [MAX_EXPERTS + 1, 800, 1.0, 0.0, 0]}},
    {"window": 50, "layers": {"0": [8, 0, 1.0, 0.0, 0]}},  # no token
    {"window": 50, "layers": {"0": [8, 800, 0.5, 0.0, 0]}},  # the busiest under the mean
    {"window": 50, "layers": {"0": [8, 800, 9.0, 0.0, 0]}},  # over all the tokens
    {"window": 50, "layers": {"0": [8, 800, 2.0, 2.7, 0]}},  # a CV above sqrt(experts - 1)
    {"window": 50, "layers": {"0": [8, 800, 2.0, 0.5, 8]}},  # every expert dead, tokens routed
    {"window": 50, "layers": {"0": [8, 800, float("nan"), 0.5, 1]}},
    {"window": 50, "layers": {"0": [8, 800, "2.0", 0.5, 1]}},
    {"window": 50, "layers": {"0": [8, 800, 2.0, 0.5, True]}},
    {"window": 50, "layers": {str(i): [2, 2, 1.0, 0.0, 0] for i in range(MAX_MOE_LAYERS + 1)}},
])
def test_bad_values_drop_the_record_with_its_reason_and_nothing_else(moe: object) -> None:
    result = decode_datagram(json.dumps([_step(moe), _step(GOOD, step=2)]).encode())
    assert [r.step for r in result.records] == [2]  # the other record of the datagram survives
    assert result.rejected == ["bad_moe"]


def test_the_encoder_refuses_what_the_agent_would_drop() -> None:
    assert encode_measured_field("moe", GOOD, 0.5).startswith(',"moe":{"window":50')
    with pytest.raises(ProtocolError) as caught:
        encode_measured_field("moe", {"window": 50, "layers": {"0": [8, 800, 9.0, 0.0, 0]}}, 0.5)
    assert caught.value.reason == "bad_moe"


def test_the_largest_summary_fits_a_datagram_beside_a_full_step() -> None:
    """64 layers of 4096 experts, 32-character names, the largest figures: the summary still
    leaves room in one datagram for a step's phases and communication."""
    layers = {f"{i:02d}".rjust(32, "L"): [MAX_EXPERTS, 2 ** 62, 4095.123456, 63.123456, 4094]
              for i in range(MAX_MOE_LAYERS)}
    obj = _step({"window": 10_000, "layers": layers})
    obj.update(phases={name: 0.1234567 for name in ("data", "forward", "backward", "optimizer", "comm")},
               comm={"exposed": 0.01, "busy": 0.02,
                     "ops": {"all_to_all": [64, 2 ** 40, 0.012345], "all_reduce": [3, 2 ** 30, 0.0123]}},
               world=1024, local_rank=7, t_start=1.7e9, pid=123456, gpu=7, samples=1024, tokens=2 ** 40)
    data = json.dumps([obj], separators=(",", ":")).encode()
    assert len(data) <= MAX_DATAGRAM_BYTES, len(data)
    assert decode_datagram(data).records[0].moe.layers[-1].experts == MAX_EXPERTS


def test_a_64_expert_32_layer_summary_is_small() -> None:
    layers = {str(i): [64, 123456, 3.123456, 0.812345, 12] for i in range(32)}
    assert len(encode_measured_field("moe", {"window": 50, "layers": layers}, 1.0)) < 1500
