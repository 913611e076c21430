"""`gpumon estimate`: its table, advice and JSON, and the command line (the classic 7B case,
ZeRO stages, bad input)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from gpumon.analysis.estimate import estimate_memory
from gpumon.commands.estimate import advice_lines, note_lines, render_table, to_json_dict
from tests.helpers import ROOT

GB = 10**9
CLASSIC_7B: dict[str, Any] = {"precision": "fp16", "optimizer": "adam", "master_weights": False,
                              "zero_stage": 0, "gpus": 1, "buffers_bytes": 0}


def test_master_copy_has_its_own_row() -> None:
    table = render_table(estimate_memory(7 * 10**9, **{**CLASSIC_7B, "master_weights": True}))
    assert "master weights (fp32)" in table and "28.0 GB" in table


def test_buffers_default_is_explicit() -> None:
    est = estimate_memory(10**9)
    assert est.buffers_default
    assert any("buffers: default" in n for n in note_lines(est))
    assert "default" in render_table(est)
    assert not estimate_memory(10**9, buffers_bytes=5).buffers_default


def test_missing_activations_are_said_not_zeroed_silently() -> None:
    est = estimate_memory(10**9)
    assert any("activations not estimated" in n for n in note_lines(est))
    assert to_json_dict(est)["activations"] == 0
    assert "not estimated" in render_table(est)


def test_fits_and_advice_when_it_fits() -> None:
    est = estimate_memory(10**9, gpus=4, gpu_memory_bytes=80 * GB)
    assert est.fits() is True
    assert advice_lines(est)[0].startswith("fits")
    assert any("data parallelism" in a for a in advice_lines(est))
    assert any("scaling is poor" in a and "communication" in a for a in advice_lines(est))
    assert est.fits(10 * GB) is False


def test_advice_when_the_classic_7b_does_not_fit_one_gpu() -> None:
    est = estimate_memory(7 * 10**9, **CLASSIC_7B, gpu_memory_bytes=80 * GB)
    text = " | ".join(advice_lines(est))
    assert advice_lines(est)[0].startswith("does not fit")
    assert "ZeRO-1 from 2 GPUs" in text and "ZeRO-3 from 2 GPUs" in text
    assert "model parallelism" in text
    assert "a smaller batch shrinks only activations" in text


def test_advice_names_the_zero_stage_that_fits_on_the_current_gpus() -> None:
    est = estimate_memory(7 * 10**9, **{**CLASSIC_7B, "gpus": 8, "master_weights": True},
                          gpu_memory_bytes=40 * GB)
    # 112 GB of model states; ZeRO-1 over 8: 28 + 12·7/8 = 38.5 GB fits 40 GB
    assert "ZeRO stage 1 over the 8 GPUs fits" in advice_lines(est)[1]


def test_advice_when_activations_alone_overflow() -> None:
    est = estimate_memory(7 * 10**9, gpus=8, layers=32, hidden=4096, heads=32, seq=4096,
                          batch=8, gpu_memory_bytes=80 * GB)
    text = " | ".join(advice_lines(est))
    assert "no ZeRO stage fits" in text
    assert "FlashAttention or selective/full recomputation" in text


def test_without_gpu_memory_fits_is_unknown() -> None:
    est = estimate_memory(10**9)
    assert est.fits() is None
    assert to_json_dict(est)["fits"] is None


def test_json_keys_are_the_contract() -> None:
    est = estimate_memory(7 * 10**9, **CLASSIC_7B, gpu_memory_bytes=80 * GB)
    data = to_json_dict(est)
    assert list(data) == ["params", "grads", "optimizer_states", "master_weights", "activations",
                          "buffers", "total", "fits", "advice"]
    assert data["total"] == 84 * GB and data["fits"] is False
    assert all(isinstance(data[k], int) for k in list(data)[:7])
    assert isinstance(data["advice"], list) and data["advice"]


def test_table_reads_like_the_classic_7b_case() -> None:
    table = render_table(estimate_memory(7 * 10**9, **CLASSIC_7B, gpu_memory_bytes=80 * GB))
    lines = table.splitlines()
    assert lines[0].startswith("7B parameters, fp16, adam")
    for label, value in [("parameters (fp16)", "14.0 GB"), ("gradients (fp16)", "14.0 GB"),
                         ("optimizer states (fp32)", "56.0 GB"), ("total", "84.0 GB"),
                         ("GPU memory", "80.0 GB")]:
        row = next(line for line in lines if line.startswith(label))
        assert value in row
    assert "does not fit" in table





def estimate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumon.cli", "estimate", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_classic_7b_case_item_by_item() -> None:
    result = estimate("--params", "7B", "--precision", "fp16", "--optimizer", "adam",
                      "--no-master-weights", "--gpus", "1", "--gpu-memory", "80GB", "--json")
    assert result.returncode == 3, result.stderr  # does not fit
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


def test_a_bare_gpu_memory_is_refused_not_read_as_bytes() -> None:
    for flag in ("--gpu-memory", "--buffers"):
        result = estimate("--params", "7B", flag, "80")
        assert result.returncode == 2
        assert result.stderr.strip() == f"gpumon: error: {flag} 80: give a unit, e.g. 80GB or 80GiB"


@pytest.mark.parametrize(("memory", "code"), [("80GB", 3), ("141GB", 0), (None, 0)])
def test_the_exit_status_says_whether_it_fits(memory: str | None, code: int) -> None:
    args = ["--params", "7B", "--precision", "bf16", "--optimizer", "adam", "--gpus", "1"]
    result = estimate(*args, *(["--gpu-memory", memory] if memory else []), "--json")
    assert result.returncode == code, result.stderr
    fits = json.loads(result.stdout)["fits"]
    assert fits is (None if memory is None else code == 0)
    help_text = " ".join(estimate("--help").stdout.split())
    assert "Exit status: 0 when it fits (or no --gpu-memory is given), 3 when it does not fit" \
        in help_text
