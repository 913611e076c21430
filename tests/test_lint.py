"""Static checks that CI runs with the tests: ruff everywhere, mypy on the package, strict on
the pure core."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_ruff_is_clean() -> None:
    result = run_tool("ruff", "check", "gpumon", "tests", "benchmarks", "examples")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_on_protocol_and_analysis() -> None:
    result = run_tool("mypy", "--strict", "gpumon/wire", "gpumon/analysis")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_on_the_package() -> None:
    result = run_tool("mypy", "gpumon")
    assert result.returncode == 0, result.stdout + result.stderr
