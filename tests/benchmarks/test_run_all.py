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
from benchmarks.run_all import BENCHMARKS, HERE, PEERS_ONLY, quick_script
from tests.helpers import ROOT

WITH_PEERS = (PEERS_VENV / "bin" / "python").exists()
"""The peers' venv (nvitop-exporter, gpustat, TensorBoard; several hundred MB from PyPI) is made
by the benchmarks on first use, never by the test suite."""


def quick_run(name: str) -> dict[str, object]:
    """Run ``name``'s tiny run; its last JSON line."""
    script = quick_script(name, WITH_PEERS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(HERE / script[0]), *script[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{script[0]} printed no JSON line:\n{proc.stdout[-2000:]}"
    return dict(json.loads(lines[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_does_a_quick_run_that_run_all_can_read(name: str) -> None:
    script, checks = BENCHMARKS[name]
    if name == "peers" and not WITH_PEERS:
        pytest.skip(f"bench_peers needs the peers' venv {PEERS_VENV} (made on the first full run)")
    result = quick_run(name)
    needs_peers = PEERS_ONLY in script and not WITH_PEERS
    read = 0
    for target, figure, show, _meets in checks:
        try:
            measured = figure(result)
        except KeyError:
            # Only the figure that compares with the peer may be missing without its venv.
            assert needs_peers and "TensorBoard" in target, target
            continue
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
