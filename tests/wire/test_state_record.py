"""The ``state`` record: a rank's word on its progress and, while stalled, its place."""

from __future__ import annotations

import json

import pytest

from gpumon.wire import (
    DROP_REASONS,
    MAX_DATAGRAM_BYTES,
    MAX_STACK_FRAMES,
    InFlight,
    StackFrame,
    StateRecord,
    decode_datagram,
    encode_record,
)

STALLED = {
    "v": 1, "kind": "state", "run": "r", "rank": 1, "state": "stalled", "t": 1_700_000_010.5,
    "steps": 15, "since": 1_700_000_000.0, "threshold": 2.0, "pid": 77, "phase": "data",
    "launched": 30, "flight": {"op": "all_reduce", "seq": 31, "bytes": 4096,
                               "since": 1_700_000_001.0, "device": False},
    "stack": [["python3.11/threading.py", 320, "Condition.wait", False],
              ["jobs/stall_job.py", 41, "read_shard", True]],
}


def decode(obj: object) -> tuple[list[object], list[str]]:
    result = decode_datagram(json.dumps(obj).encode())
    return list(result.records), result.rejected


def test_a_stall_report_round_trips() -> None:
    [record], rejected = decode(STALLED)
    assert rejected == []
    assert isinstance(record, StateRecord)
    assert record.in_flight == InFlight("all_reduce", 31, 4096, 1_700_000_001.0, False)
    assert record.location == StackFrame("jobs/stall_job.py", 41, "read_shard", True)
    assert json.loads(encode_record(record)) == STALLED


def test_a_heartbeat_needs_only_its_identity_state_time_and_steps() -> None:
    [record], rejected = decode({"v": 1, "kind": "state", "run": "r", "rank": 0,
                                 "state": "stepping", "t": 1.0, "steps": 0})
    assert rejected == [] and isinstance(record, StateRecord) and record.location is None


@pytest.mark.parametrize(("change", "reason"), [
    ({"state": "hung"}, "bad_state"),
    ({"state": None}, "missing_field"),
    ({"steps": None}, "missing_field"),
    ({"steps": -1}, "bad_value"),
    ({"t": float("inf")}, "bad_value"),
    ({"threshold": 1e9}, "bad_value"),
    ({"phase": "for ward"}, "bad_label"),
    ({"flight": {"op": "all_reduce", "seq": 1, "bytes": 1}}, "bad_state"),
    ({"flight": {"op": "all reduce", "seq": 1, "bytes": 1, "since": 1.0}}, "bad_state"),
    ({"flight": {"op": "all_reduce", "seq": 1, "bytes": -1, "since": 1.0}}, "bad_state"),
    ({"flight": {"op": "all_reduce", "seq": 1, "bytes": 1, "since": 1.0, "device": 1}}, "bad_state"),
    ({"flight": []}, "bad_state"),
    ({"stack": [["f.py", 1, "g"]]}, "bad_stack"),
    ({"stack": [["f.py", -1, "g", True]]}, "bad_stack"),
    ({"stack": [["f.py", 1, "", True]]}, "bad_stack"),
    ({"stack": [["f.py", 1, "g\n", True]]}, "bad_stack"),
    ({"stack": [["x" * 129, 1, "g", True]]}, "bad_stack"),
    ({"stack": [["f.py", 1, "g", True]] * (MAX_STACK_FRAMES + 1)}, "bad_stack"),
    ({"stack": {"f.py": 1}}, "bad_stack"),
])
def test_a_bad_state_record_is_dropped_with_its_reason(change: dict[str, object], reason: str) -> None:
    obj = {**STALLED, **change}
    obj = {k: v for k, v in obj.items() if v is not None}
    text = json.dumps(obj).encode()
    result = decode_datagram(text)
    assert result.records == [] and result.rejected == [reason]
    assert reason in DROP_REASONS


def test_a_bad_state_record_costs_nothing_else_in_its_datagram() -> None:
    step = {"v": 1, "kind": "step", "run": "r", "rank": 0, "step": 0, "duration": 0.5}
    result = decode_datagram(json.dumps([{**STALLED, "state": "x"}, step]).encode())
    assert len(result.records) == 1 and result.rejected == ["bad_state"]


def test_the_largest_valid_stack_fits_a_datagram_only_when_cut() -> None:
    frame = ["d/" + "f" * 120 + ".py", 10**6, "g" * 128, True]
    big = {**STALLED, "stack": [frame] * MAX_STACK_FRAMES}
    assert len(json.dumps(big)) > MAX_DATAGRAM_BYTES  # the client cuts the stack to fit
    assert decode(big)[1] == ["too_large"]
