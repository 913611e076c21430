"""Every benchmark of benchmarks/run_all.py still runs: a tiny run of each (run_all's --quick
arguments), its JSON line read by run_all's own figure functions. The figures of so short a
run mean nothing; that the benchmark starts, runs every part once and reports is the point."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks.common import PEERS_VENV
from benchmarks.run_all import BENCHMARKS, HERE, quick_script
from tests.helpers import ROOT


def quick_run(name: str) -> dict[str, object]:
    """Run ``name``'s tiny run; its last JSON line."""
    script = quick_script(name, with_peers=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(HERE / script[0]), *script[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{script[0]} printed no JSON line:\n{proc.stdout[-2000:]}"
    return dict(json.loads(lines[-1]))


WAITING = {"fleet"}
"""Benchmarks whose quick run mostly waits on its stores' intervals (see scripts/test)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.waits) if n in WAITING else n
                                  for n in sorted(BENCHMARKS)])
def test_benchmark_does_a_quick_run_that_run_all_can_read(name: str) -> None:
    _, checks = BENCHMARKS[name]
    # The peers' venv (nvitop-exporter, gpustat, TensorBoard) is made by scripts/test; a
    # checkout without it fails here, naming it, rather than skipping the comparisons.
    assert (PEERS_VENV / "bin" / "python").exists(), f"no peers' venv at {PEERS_VENV}: run scripts/test"
    result = quick_run(name)
    read = 0
    for target, figure, show, _meets in checks:
        measured = figure(result)
        assert isinstance(measured, float | int), (target, measured)
        assert not math.isinf(measured), (target, measured)
        show(measured)
        read += 1
    assert read >= 1


def test_quick_arguments_cover_every_benchmark_and_name_real_flags() -> None:
    for name, (script, _) in BENCHMARKS.items():
        proc = subprocess.run([sys.executable, str(HERE / script[0]), "--help"], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        flags = [a for a in quick_script(name, True)[1:] if a.startswith("--")]
        assert flags, name
        for flag in flags:
            assert flag in proc.stdout, (name, flag)
