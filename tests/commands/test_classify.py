"""`gpumon classify` on the labelled recordings of tests/data/ (see make_recordings.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.accuracy import DATA, scenario_accuracy
from tests.helpers import ROOT

SCENARIOS = sorted(d for d in DATA.iterdir() if (d / "labels.json").exists())


def test_every_class_has_a_labelled_recording() -> None:
    labels = {json.loads((d / "labels.json").read_text())["primary"] for d in SCENARIOS}
    assert {"input", "not_input", "communication", "memory_bandwidth", "compute"} <= labels


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda d: d.name)
def test_step_accuracy(scenario: Path) -> None:
    label, right, total = scenario_accuracy(scenario)
    assert total >= 50, "recording too short to say anything"
    assert right / total >= 0.9, f"{scenario.name}: {right}/{total} steps classified {label}"


def test_classify_json_lines_then_summary() -> None:
    recording = DATA / "gpu_communication" / "recording.jsonl"
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "classify", str(recording),
                             "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    steps, summary = lines[:-1], lines[-1]["summary"]
    assert set(steps[0]) == {"run", "rank", "step", "primary", "confidence", "flags"}
    recorded = [json.loads(line) for line in recording.read_text().splitlines()]
    assert sorted(s["step"] for s in steps) == sorted(r["step"] for r in recorded
                                                     if r["kind"] == "step")
    assert summary["steps"] == len(steps)
    assert summary["bottlenecks"]["communication"] >= 0.9 * len(steps)


def test_classify_survives_a_damaged_recording(tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.jsonl"
    good = (DATA / "gpu_compute" / "recording.jsonl").read_text().splitlines()
    damaged.write_text("\n".join([good[0], "{not json", '{"kind": "step", "v": 1}',
                                  '{"kind": "mystery"}', *good[1:200]]) + "\n")
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "classify", str(damaged),
                             "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])["summary"]
    assert summary["skipped_lines"] == {"not_json": 1, "missing_field": 1, "unknown_kind": 1}
    assert result.stderr.splitlines() == [
        f"gpumon classify: {damaged}:2: skipped (not_json)",
        f"gpumon classify: {damaged}:3: skipped (missing_field)",
        f"gpumon classify: {damaged}:4: skipped (unknown_kind)"]


def test_classify_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "classify",
                             str(tmp_path / "nope.jsonl")], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("No such file or directory")
    assert result.stderr.startswith("gpumon: error: cannot read")


@pytest.mark.parametrize("text", [
    '{"kind":"step","a":1}\n', '{"a":1}', ' {"a":1}', '{"a":1} \n', '{"a":1}\r\n', '{"a":1}\t',
    '[1,2]\n\n', '"s"\n', '1e999', '{"a":NaN,"b":-Infinity}\n', '{"a":"\\u00e9\\n"}\n',
    '\ufeff{"a":1}', '{"a":1}x', '{"a":1}\n{"b":2}\n', '{"a":1}\x0b', '', '  ', '{"a":', '{"a":01}',
])
def test_a_line_is_read_as_json_loads_reads_it(text: str) -> None:
    """The recording's reader (``classify._loads``) gives ``json.loads``'s value, or its error,
    whatever is around the value."""
    from gpumon.commands.classify import _loads

    def outcome(loads: object) -> tuple[str, str]:
        try:
            return "value", repr(loads(text))  # type: ignore[operator]
        except ValueError as exc:
            return type(exc).__name__, str(exc)

    assert outcome(_loads) == outcome(json.loads)
