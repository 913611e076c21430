"""Wire protocol: encoding, validation with counted reasons, and never raising on any input."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.wire import (
    DROP_REASONS,
    MAX_DATAGRAM_BYTES,
    MAX_RECORDS_PER_DATAGRAM,
    EventRecord,
    HelloRecord,
    MemoryStats,
    StepRecord,
    decode_datagram,
    encode_datagrams,
    encode_record,
    to_wire,
)

FULL_STEP = {
    "v": 1,
    "kind": "step",
    "run": "llama-7b-sft",
    "rank": 3,
    "world": 8,
    "local_rank": 3,
    "step": 1200,
    "t_start": 1_700_000_000.25,
    "duration": 0.5,
    "phases": {"data": 0.1, "forward": 0.15, "backward": 0.2, "optimizer": 0.05},
    "samples": 32,
    "tokens": 65536,
    "flops": 2.75e15,
    "gpu": "GPU-5e0c7dd2-0000-1111-2222-333344445555",
    "pid": 4242,
    "mem": {"allocated": 10, "reserved": 20, "peak": 15, "retries": 0, "ooms": 0},
}
MINIMAL_STEP = {"v": 1, "kind": "step", "run": "r", "rank": 0, "step": 0, "duration": 0.0}
EVENT = {"v": 1, "kind": "event", "run": "r", "rank": 0, "event": "oom", "message": "CUDA ☃"}
HELLO = {"v": 1, "kind": "hello", "run": "r", "rank": 1, "world": 2, "client_version": "0.1.0"}


def one(obj: object) -> tuple[list[object], list[str]]:
    result = decode_datagram(json.dumps(obj).encode())
    return list(result.records), result.rejected


def test_full_step_round_trips_through_dataclass_and_wire() -> None:
    [record], rejected = one(FULL_STEP)
    assert rejected == []
    assert isinstance(record, StepRecord)
    assert record.phases_s["backward"] == 0.2
    assert record.mem == MemoryStats(10, 20, 15, 0, 0)
    assert record.gpu == FULL_STEP["gpu"]
    assert record.t_end == pytest.approx(1_700_000_000.75)
    assert to_wire(record) == FULL_STEP


def test_minimal_step_event_and_hello_decode() -> None:
    records, rejected = one([MINIMAL_STEP, EVENT, HELLO])
    assert rejected == []
    step, event, hello = records
    assert step == StepRecord(run="r", rank=0, step=0, duration_s=0.0)
    assert event == EventRecord(run="r", rank=0, event="oom", message="CUDA ☃")
    assert hello == HelloRecord(run="r", rank=1, world=2, client_version="0.1.0")
    assert [to_wire(r) for r in records] == [MINIMAL_STEP, EVENT, HELLO]


def test_integer_gpu_index_and_integer_durations_are_accepted() -> None:
    [record], _ = one({**MINIMAL_STEP, "gpu": 7, "duration": 2, "phases": {"forward": 1}})
    assert record.gpu == 7 and record.duration_s == 2.0


def test_encode_datagrams_splits_batches_under_the_limit_and_keeps_order() -> None:
    records = [{**FULL_STEP, "step": i} for i in range(200)]
    datagrams = encode_datagrams(records)
    assert len(datagrams) > 1
    assert all(len(d) <= MAX_DATAGRAM_BYTES for d in datagrams)
    decoded = [r for d in datagrams for r in decode_datagram(d).records]
    assert [r.step for r in decoded] == list(range(200))


def test_encoding_accepts_dataclasses_and_mappings() -> None:
    record = StepRecord(run="r", rank=0, step=5, duration_s=1.0)
    [data] = encode_datagrams([record, to_wire(record)])
    assert json.loads(data) == [to_wire(record)] * 2
    assert encode_record(record) == encode_record(to_wire(record))


def test_encoding_refuses_nan() -> None:
    with pytest.raises(ValueError):
        encode_datagrams([{**MINIMAL_STEP, "duration": math.nan}])


def with_(**changes: object) -> dict[str, object]:
    return {**FULL_STEP, **changes}


def without(key: str) -> dict[str, object]:
    return {k: v for k, v in FULL_STEP.items() if k != key}


REJECTIONS = [
    ("not_object", 5),
    ("not_object", "step"),
    ("not_object", [[FULL_STEP]]),  # a batch inside a batch
    ("missing_field", without("v")),
    ("bad_version", with_(v=2)),
    ("bad_version", with_(v=True)),
    ("bad_version", with_(v="1")),
    ("missing_field", without("kind")),
    ("bad_kind", with_(kind="gpu")),
    ("bad_kind", with_(kind=1)),
    ("missing_field", without("run")),
    ("missing_field", without("rank")),
    ("missing_field", without("step")),
    ("missing_field", without("duration")),
    ("missing_field", with_(duration=None)),
    ("bad_type", with_(rank=True)),
    ("bad_type", with_(rank=1.0)),
    ("bad_type", with_(step="3")),
    ("bad_type", with_(duration="0.5")),
    ("bad_type", with_(duration=False)),
    ("bad_type", with_(samples=True)),
    ("bad_type", with_(flops=[1])),
    ("bad_type", with_(run=7)),
    ("bad_type", with_(phases=[0.1])),
    ("bad_type", with_(phases={"forward": "0.1"})),
    ("bad_type", with_(mem=5)),
    ("bad_type", with_(mem={"allocated": 1.5})),
    ("bad_type", with_(gpu=1.0)),
    ("bad_value", with_(rank=-1)),
    ("bad_value", with_(rank=8)),  # rank must be below world
    ("bad_value", with_(local_rank=8)),
    ("bad_value", with_(world=0)),
    ("bad_value", with_(step=2**63)),
    ("bad_value", with_(tokens=-5)),
    ("bad_value", with_(duration=-0.1)),
    ("bad_value", with_(duration=86_400)),
    ("bad_value", with_(duration=1e400)),  # json turns it into inf
    ("bad_value", with_(flops=10**400)),  # an int beyond float range
    ("bad_value", with_(t_start=-1.0)),
    ("bad_value", with_(pid=0)),
    ("bad_value", with_(gpu=-1)),
    ("bad_value", with_(phases={"forward": 0.6})),  # longer than its step
    ("bad_value", with_(phases={"forward": -0.01})),
    ("bad_value", with_(phases={f"p{i}": 0.01 for i in range(33)})),
    ("bad_value", with_(mem={"peak": -1})),
    ("bad_label", with_(run="")),
    ("bad_label", with_(run="my run")),
    ("bad_label", with_(run="r" * 129)),
    ("bad_label", with_(run='x"}{')),
    ("bad_label", with_(run="ünïcode")),
    ("bad_label", with_(phases={"for ward": 0.1})),
    ("bad_label", with_(phases={"": 0.1})),
    ("bad_label", with_(gpu="GPU 0")),
    ("missing_field", {**EVENT, "event": None}),
    ("bad_label", {**EVENT, "event": "out of memory"}),
    ("bad_value", {**EVENT, "message": "x" * 1025}),
    ("bad_value", {**EVENT, "message": "\ud800"}),
    ("bad_type", {**EVENT, "message": 3}),
    ("bad_label", {**HELLO, "client_version": "0.1 beta"}),
]


@pytest.mark.parametrize(("reason", "obj"), REJECTIONS)
def test_invalid_objects_are_rejected_with_their_reason(reason: str, obj: object) -> None:
    assert reason in DROP_REASONS
    assert one(obj) == ([], [reason])


def test_nan_literal_is_a_bad_value() -> None:
    data = json.dumps(FULL_STEP).replace('"duration": 0.5', '"duration": NaN').encode()
    assert decode_datagram(data).rejected == ["bad_value"]


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    records, rejected = one(with_(future_field={"x": 1}, mem={**FULL_STEP["mem"], "new": 1}))
    assert len(records) == 1 and rejected == []


def test_null_optional_fields_count_as_absent() -> None:
    [record], _ = one(with_(samples=None, mem=None, phases=None))
    assert record.samples is None and record.mem is None and record.phases_s == {}


def test_a_batch_keeps_its_good_elements() -> None:
    batch = [FULL_STEP, with_(rank=-1), 7, MINIMAL_STEP, with_(run="a b")]
    records, rejected = one(batch)
    assert [r.run for r in records] == ["llama-7b-sft", "r"]
    assert rejected == ["bad_value", "not_object", "bad_label"]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\xff\xfe{}", "not_utf8"),
        (b"{", "not_json"),
        (b"", "not_json"),
        (b"[" * 4000 + b"]" * 4000, "not_json"),  # nesting beyond the recursion limit
        (b"9" * 5000, "not_json"),  # beyond the int-string conversion limit
        (b"[" + b"1," * 300 + b"1]", "too_many_records"),
        (b" " * (MAX_DATAGRAM_BYTES + 1), "too_large"),
    ],
)
def test_malformed_datagrams_are_one_rejection(data: bytes, reason: str) -> None:
    result = decode_datagram(data)
    assert (result.records, result.rejected) == ([], [reason])


def test_empty_batch_holds_nothing() -> None:
    result = decode_datagram(b"[]")
    assert (result.records, result.rejected) == ([], [])


def objects_in(data: bytes) -> int | None:
    """How many objects a datagram claims to hold, or None when it is rejected whole."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if isinstance(value, list):
        return len(value) if len(value) <= MAX_RECORDS_PER_DATAGRAM else None
    return 1


def assert_accounted(data: bytes) -> None:
    result = decode_datagram(data)
    assert set(result.rejected) <= set(DROP_REASONS)
    expected = objects_in(data) if len(data) <= MAX_DATAGRAM_BYTES else None
    if expected is None:
        assert (result.records, len(result.rejected)) == ([], 1)
    else:
        assert len(result.records) + len(result.rejected) == expected


@settings(max_examples=500)
@given(st.binary(max_size=MAX_DATAGRAM_BYTES + 16))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    assert_accounted(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=10), children, max_size=6)
    ),
    max_leaves=40,
)


@settings(max_examples=500)
@given(json_values)
def test_arbitrary_json_values_never_raise(value: object) -> None:
    assert_accounted(json.dumps(value).encode())


field_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=200),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=8), st.floats(), max_size=40),
)


@settings(max_examples=1000)
@given(
    base=st.sampled_from([FULL_STEP, MINIMAL_STEP, EVENT, HELLO]),
    changes=st.dictionaries(st.sampled_from(sorted(FULL_STEP) + ["event", "message", "comm", "memb"]),
                            field_values),
)
def test_mutated_records_are_either_valid_or_one_rejection(
    base: dict[str, object], changes: dict[str, object]
) -> None:
    obj = {**base, **changes}
    result = decode_datagram(json.dumps(obj).encode())
    assert len(result.records) + len(result.rejected) == 1
    if result.records:
        # Whatever was accepted is re-encodable and decodes to the same record.
        [record] = result.records
        assert decode_datagram(encode_record(record)).records == [record]


@settings(max_examples=200)
@given(
    st.lists(
        st.builds(
            StepRecord,
            run=st.from_regex(r"[A-Za-z0-9_.:/-]{1,128}", fullmatch=True),
            rank=st.integers(0, 1000),
            step=st.integers(0, 2**63 - 1),
            duration_s=st.floats(0, 86_399),
            samples=st.none() | st.integers(0, 2**63 - 1),
            flops=st.none() | st.floats(0, 1e30),
        ),
        max_size=100,
    )
)
def test_valid_records_survive_encode_split_decode(records: list[StepRecord]) -> None:
    datagrams = encode_datagrams(records)
    assert all(len(d) <= MAX_DATAGRAM_BYTES for d in datagrams)
    decoded = [r for d in datagrams for r in decode_datagram(d).records]
    assert decoded == records
