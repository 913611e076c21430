"""`gpumon estimate` from the command line: the classic 7B case, ZeRO stages, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

GB = 1e9


def estimate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumon.cli", "estimate", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_seed_7b_case_item_by_item() -> None:
    result = estimate("--params", "7B", "--precision", "fp16", "--optimizer", "adam",
                      "--no-master-weights", "--gpus", "1", "--gpu-memory", "80GB", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"params", "grads", "optimizer_states", "master_weights",
                         "activations", "buffers", "total", "fits", "advice"}
    assert data["params"] == 14 * GB and data["grads"] == 14 * GB
    assert data["optimizer_states"] == 56 * GB and data["master_weights"] == 0
    assert data["params"] + data["grads"] + data["optimizer_states"] == 84 * GB
    assert data["fits"] is False
    assert any("ZeRO" in line for line in data["advice"])


def test_master_copy_is_its_own_item() -> None:
    data = json.loads(estimate("--params", "7B", "--precision", "fp16", "--optimizer", "adam",
                               "--master-weights", "--json").stdout)
    assert data["master_weights"] == 28 * GB and data["optimizer_states"] == 56 * GB


@pytest.mark.parametrize(("stage", "gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_on_64_gpus(stage: int, gb: float) -> None:
    data = json.loads(estimate("--params", "7.5B", "--precision", "fp16", "--optimizer", "adam",
                               "--master-weights", "--zero-stage", str(stage), "--gpus", "64",
                               "--buffers", "0GB", "--json").stdout)
    model_states = data["params"] + data["grads"] + data["optimizer_states"] + \
        data["master_weights"]
    assert round(model_states / GB, 1) == gb


def test_table_is_the_default() -> None:
    result = estimate("--params", "7B", "--precision", "fp16", "--optimizer", "adam",
                      "--no-master-weights", "--layers", "32", "--hidden", "4096",
                      "--heads", "32", "--seq", "2048", "--batch", "8", "--flash-attention")
    assert result.returncode == 0
    assert any(line.startswith("parameters (fp16)") and line.split()[-2:] == ["14.0", "GB"]
               for line in result.stdout.splitlines())
    assert "activations" in result.stdout and "not estimated" not in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--params", "7Q"], "not a count"),
    (["--params", "7B", "--precision", "fp8"], "precision"),
    (["--params", "7B", "--layers", "32"], "missing: hidden, heads, seq, batch"),
    (["--params", "7B", "--zero-stage", "4"], "zero-stage"),
])
def test_bad_input_is_one_clear_error(args: list[str], message: str) -> None:
    result = estimate(*args)
    assert result.returncode == 2
    assert message in result.stderr
