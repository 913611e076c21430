"""The step record's optional ``dev`` field: which of its phases are GPU time (CUDA events)
rather than host-clock time. Decoded into ``StepRecord.device_phases``, re-encoded unchanged,
written by the client's encoder only for phases it sends, refused as ``bad_device_phases``
when it names anything but the record's own phases, and carried through a recording."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumon.agent.recorder import Recorder
from gpumon.commands.classify import load_recording
from gpumon.wire import DROP_REASONS, MAX_PHASES, StepEncoder, StepRecord, decode_datagram, to_wire

STEP = {"v": 1, "kind": "step", "run": "gpu", "rank": 0, "step": 3, "duration": 0.002,
        "phases": {"data": 0.0001, "forward": 0.0008, "backward": 0.001}}


def decode(obj: object) -> tuple[list[object], list[str]]:
    result = decode_datagram(json.dumps(obj).encode())
    return list(result.records), result.rejected


def test_dev_decodes_and_round_trips() -> None:
    [record], rejected = decode({**STEP, "dev": ["forward", "backward"]})
    assert rejected == [] and isinstance(record, StepRecord)
    assert record.device_phases == ("forward", "backward")
    assert to_wire(record)["dev"] == ["forward", "backward"]
    [again], _ = decode(to_wire(record))
    assert again == record


def test_records_without_dev_stay_valid_and_are_host_timed() -> None:
    [record], rejected = decode(STEP)
    assert rejected == [] and isinstance(record, StepRecord) and record.device_phases is None
    assert "dev" not in to_wire(record)
    [empty], _ = decode({**STEP, "dev": []})  # valid: a CUDA step whose events were not read
    assert isinstance(empty, StepRecord) and empty.device_phases == ()


BAD_DEV = [
    ("not a list", "forward"),
    ("an object", {"forward": True}),
    ("not one of its phases", ["optimizer"]),
    ("a number", [1]),
    ("a nested list", [["forward"]]),
    ("named twice", ["forward", "forward"]),
    ("not a label", ["for ward"]),
]


@pytest.mark.parametrize(("case", "dev"), BAD_DEV, ids=[c for c, _ in BAD_DEV])
def test_bad_dev_is_dropped_with_its_own_reason(case: str, dev: object) -> None:
    assert "bad_device_phases" in DROP_REASONS
    assert decode({**STEP, "dev": dev}) == ([], ["bad_device_phases"])


def test_dev_without_phases_is_refused() -> None:
    step = {k: v for k, v in STEP.items() if k != "phases"}
    assert decode({**step, "dev": ["forward"]}) == ([], ["bad_device_phases"])


def test_the_client_encoder_lists_only_phases_it_sends() -> None:
    encoder = StepEncoder("gpu", 0)
    phases = {"data": 0.0001, "forward": 0.0008, "backward": 0.001}
    text = encoder.encode(None, 0, 1.7e9, 0.002, phases, device_phases=("forward", "backward", "forward"))
    [record], rejected = decode(json.loads(text))
    assert rejected == [] and record.device_phases == ("forward", "backward")  # type: ignore[attr-defined]
    plain = encoder.encode(None, 1, 1.7e9, 0.002, phases)
    assert '"dev"' not in plain and encoder.invalid_fields == 0
    # More phases than a record holds fold into "other": which were GPU time is lost, so no dev.
    many = {f"p{i}": 0.00001 for i in range(MAX_PHASES + 3)}
    folded = encoder.encode(None, 2, 1.7e9, 0.002, many, device_phases=("p0",))
    assert '"dev"' not in folded and encoder.invalid_fields == 1
    assert decode(json.loads(folded))[1] == []


def test_recording_and_replay_carry_dev(tmp_path: Path) -> None:
    [record], _ = decode({**STEP, "t_start": 1.7e9, "dev": ["backward"]})
    path = tmp_path / "run.jsonl"
    recorder = Recorder(path)
    recorder.steps([record])  # type: ignore[list-item]
    recorder.close()
    line = json.loads(path.read_text())
    assert line["dev"] == ["backward"]
    recording = load_recording(path.read_text().splitlines())
    assert recording.steps == [record] and recording.steps[0].device_phases == ("backward",)
