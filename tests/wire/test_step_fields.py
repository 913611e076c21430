"""The step record's optional ``comm`` (measured collectives), ``memb`` (sampled memory
breakdown) and ``cpu_wait`` (the training thread's wait for a CPU) fields: decoded into
dataclasses, re-encoded unchanged, each bad value dropped with its own reason, and carried
through a recording and its replay."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gpumon.agent.recorder import Recorder
from gpumon.commands.classify import load_recording
from gpumon.wire import (
    DROP_REASONS,
    MAX_COLLECTIVE_KINDS,
    MEMORY_COMPONENTS,
    CollectiveOp,
    CommStats,
    MemoryBreakdown,
    StepRecord,
    decode_datagram,
    encode_record,
    to_wire,
)

STEP = {"v": 1, "kind": "step", "run": "ddp", "rank": 1, "world": 2, "step": 7, "duration": 0.12}
COMM = {
    "exposed": 0.075,
    "busy": 0.09,
    "ops": {"all_reduce": [4, 102_760_448, 0.081], "broadcast": [1, 4096, 0.0005]},
}
MEMB = {"parameters": 1 << 30, "gradients": 1 << 30, "optimizer_states": 1 << 31,
        "activations": 5_000_000, "other": 0}


def decode(obj: object) -> tuple[list[object], list[str]]:
    result = decode_datagram(json.dumps(obj).encode())
    return list(result.records), result.rejected


def test_comm_and_breakdown_decode_into_their_dataclasses_and_round_trip() -> None:
    wire = {**STEP, "comm": COMM, "memb": MEMB}
    [record], rejected = decode(wire)
    assert rejected == []
    assert isinstance(record, StepRecord)
    assert record.comm == CommStats(
        exposed_s=0.075,
        busy_s=0.09,
        ops=(CollectiveOp("all_reduce", 4, 102_760_448, 0.081), CollectiveOp("broadcast", 1, 4096, 0.0005)),
    )
    assert record.memory_breakdown == MemoryBreakdown(1 << 30, 1 << 30, 1 << 31, 5_000_000, 0)
    assert to_wire(record) == wire
    assert decode_datagram(encode_record(record)).records == [record]


def test_records_without_them_stay_valid_and_say_not_measured() -> None:
    [record], rejected = decode(STEP)
    assert rejected == []
    assert isinstance(record, StepRecord)
    assert record.comm is None and record.memory_breakdown is None
    assert "comm" not in to_wire(record) and "memb" not in to_wire(record)
    [nulls], _ = decode({**STEP, "comm": None, "memb": None})
    assert nulls == record


def test_every_component_is_optional_and_the_order_is_one_tuple() -> None:
    assert MEMORY_COMPONENTS == ("parameters", "gradients", "optimizer_states", "activations", "other")
    assert tuple(MemoryBreakdown.__dataclass_fields__) == MEMORY_COMPONENTS
    [record], _ = decode({**STEP, "memb": {"activations": 12, "future_part": 3}})
    assert record.memory_breakdown == MemoryBreakdown(activations=12)
    assert to_wire(record)["memb"] == {"activations": 12}


def test_comm_without_ops_and_integer_seconds_are_accepted() -> None:
    [record], rejected = decode({**STEP, "duration": 2, "comm": {"exposed": 0, "busy": 1}})
    assert rejected == []
    assert record.comm == CommStats(0.0, 1.0, ())
    assert to_wire(record)["comm"] == {"exposed": 0.0, "busy": 1.0}


def test_comm_may_reach_the_duration_within_the_phase_slack() -> None:
    # Clients round; a collective ending as the step ends may measure a hair over it.
    [record], rejected = decode({**STEP, "comm": {"exposed": 0.1211, "busy": 0.1211}})
    assert rejected == [] and record.comm.busy_s == 0.1211


def test_cpu_wait_is_seconds_within_the_step() -> None:
    [record], rejected = decode({**STEP, "cpu_wait": 0.031})
    assert rejected == [] and record.cpu_wait_s == 0.031
    assert to_wire(record)["cpu_wait"] == 0.031
    assert decode_datagram(encode_record(record)).records == [record]
    [plain], _ = decode(STEP)
    assert plain.cpu_wait_s is None and "cpu_wait" not in to_wire(plain)
    for bad, reason in ((0.5, "bad_value"), (-0.01, "bad_value"), (math.nan, "bad_value"),
                        ("0.01", "bad_type"), (True, "bad_type")):
        assert decode({**STEP, "cpu_wait": bad}) == ([], [reason]), bad


def with_comm(**changes: object) -> dict[str, object]:
    comm = {**COMM, **changes}
    return {**STEP, "comm": {k: v for k, v in comm.items() if v is not MISSING}}


def with_op(figures: object, name: str = "all_reduce") -> dict[str, object]:
    return with_comm(ops={name: figures})


MISSING = object()

BAD_COMM = [
    ("not an object", {**STEP, "comm": [0.1, 0.1]}),
    ("exposed missing", with_comm(exposed=MISSING)),
    ("busy missing", with_comm(busy=MISSING)),
    ("exposed over the duration", with_comm(exposed=0.2)),
    ("busy over the duration", with_comm(busy=0.5)),
    ("negative exposed", with_comm(exposed=-0.001)),
    ("negative busy", with_comm(busy=-1)),
    ("exposed a string", with_comm(exposed="0.1")),
    ("busy a bool", with_comm(busy=True)),
    ("exposed NaN", with_comm(exposed=math.nan)),
    ("busy infinite", with_comm(busy=math.inf)),
    ("ops a list", with_comm(ops=[["all_reduce", 1, 2, 0.1]])),
    ("too many kinds", with_comm(ops={f"op{i}": [1, 1, 0.0] for i in range(MAX_COLLECTIVE_KINDS + 1)})),
    ("kind with a space", with_op([1, 1, 0.0], name="all reduce")),
    ("kind too long", with_op([1, 1, 0.0], name="a" * 33)),
    ("empty kind", with_op([1, 1, 0.0], name="")),
    ("figures not a list", with_op({"count": 1})),
    ("two figures", with_op([1, 1])),
    ("negative count", with_op([-1, 1, 0.0])),
    ("float count", with_op([1.0, 1, 0.0])),
    ("bool bytes", with_op([1, True, 0.0])),
    ("bytes beyond int64", with_op([1, 2**63, 0.0])),
    ("negative seconds", with_op([1, 1, -0.5])),
    ("NaN seconds", with_op([1, 1, math.nan])),
    ("seconds a string", with_op([1, 1, "0.1"])),
]


@pytest.mark.parametrize(("case", "obj"), BAD_COMM, ids=[c for c, _ in BAD_COMM])
def test_bad_comm_is_dropped_as_bad_comm(case: str, obj: object) -> None:
    assert "bad_comm" in DROP_REASONS
    assert decode(obj) == ([], ["bad_comm"])


def test_summed_op_seconds_may_exceed_the_step() -> None:
    # Buckets overlap: their summed time is not bounded by the step, only the union (busy) is.
    [record], rejected = decode(with_op([8, 1 << 20, 0.3]))
    assert rejected == [] and record.comm.ops[0].seconds == 0.3


BAD_MEMB = [
    ("not an object", [1, 2, 3]),
    ("negative", {"parameters": -1}),
    ("a float", {"gradients": 1.5}),
    ("a bool", {"optimizer_states": True}),
    ("a string", {"activations": "12"}),
    ("beyond int64", {"other": 2**63}),
]


@pytest.mark.parametrize(("case", "memb"), BAD_MEMB, ids=[c for c, _ in BAD_MEMB])
def test_bad_breakdown_is_dropped_as_bad_memory_breakdown(case: str, memb: object) -> None:
    assert "bad_memory_breakdown" in DROP_REASONS
    assert decode({**STEP, "memb": memb}) == ([], ["bad_memory_breakdown"])


def test_a_bad_field_costs_only_its_own_record() -> None:
    batch = [{**STEP, "comm": COMM}, with_comm(busy=-1), {**STEP, "memb": {"other": -1}}, STEP]
    records, rejected = decode(batch)
    assert [r.comm is not None for r in records] == [True, False]  # type: ignore[attr-defined]
    assert rejected == ["bad_comm", "bad_memory_breakdown"]


def test_recording_and_replay_carry_both_fields(tmp_path: Path) -> None:
    [record], _ = decode({**STEP, "t_start": 1.7e9, "comm": COMM, "memb": MEMB})
    path = tmp_path / "run.jsonl"
    recorder = Recorder(path)
    recorder.steps([record])
    recorder.close()
    line = json.loads(path.read_text())
    assert line["comm"] == COMM and line["memb"] == MEMB
    recording = load_recording(path.read_text().splitlines())
    assert recording.steps == [record]
