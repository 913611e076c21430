"""The breakdown against PyTorch's own memory profiler, which categorises every allocation
offline (parameter, gradient, optimizer state, activation, ...): the device script's memory
section, run here on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu_checks.memory import memory_breakdown_check


def test_breakdown_agrees_with_the_pytorch_memory_profiler(tmp_path: Path) -> None:
    result = memory_breakdown_check(tmp_path, steps=2)
    # The torch scripts/setup installs has the profiler's memory timeline: its absence fails.
    assert "ratio_to_profiler" in result, result
    ratios = result["ratio_to_profiler"]
    for part in ("parameters", "gradients", "optimizer_states"):
        assert ratios[part] == pytest.approx(1.0, abs=0.02), part
    assert ratios["activations"] == pytest.approx(1.0, abs=0.25)
    assert json.loads((tmp_path / "memory_breakdown.json").read_text())["samples"] >= 2
