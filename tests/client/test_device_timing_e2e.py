"""The ``dev`` field end to end: a monitor timing phases on a fake GPU on a sample of steps,
through the real socket to a real agent recording them, then ``gpumon classify`` on the file.

The GPU is ``FakeCuda`` (tests/client/test_cuda_timing.py) because this machine has none;
everything after the clock (core, sender, socket, agent, recorder, classify) is the real one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumon.client import StepMonitor
from gpumon.client.core import cuda_clock
from tests.client.test_cuda_timing import FakeCuda
from tests.helpers import ROOT, start_agent, wait_for

STEPS = 60
FORWARD_GPU_S, BACKWARD_GPU_S = 0.004, 0.006


def test_sampled_gpu_timing_reaches_the_recording_and_classify(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeCuda()
    monkeypatch.setattr(cuda_clock, "detect", lambda reset_peak: cuda_clock.CudaClock(
        fake, 0, reset_peak, memory_interval_s=0.0, device_interval_s=0.03))
    recording = tmp_path / "run.jsonl"
    agent = start_agent(tmp_path, "--simulate", "1", "--interval", "0.2",
                        "--record", str(recording))
    try:
        mon = StepMonitor(run="sampled", socket_path=str(agent.socket_path), rank=0, world=1)
        for n in range(STEPS):
            with mon.step(step=n, samples=8):
                with mon.phase("data"):
                    time.sleep(0.001)
                with mon.phase("forward"):
                    fake.gpu_time_s += FORWARD_GPU_S
                with mon.phase("backward"):
                    fake.gpu_time_s += BACKWARD_GPU_S
                time.sleep(0.01)
        mon.close()
        wait_for(lambda: recording.exists()
                 and recording.read_text().count('"kind":"step"') == STEPS, what="every step recorded")
    finally:
        assert agent.stop() == 0, agent.log()
    steps = [json.loads(line) for line in recording.read_text().splitlines()
             if '"kind":"step"' in line]
    timed = [s for s in steps if "dev" in s]
    host = [s for s in steps if "dev" not in s]
    # About one step in three is GPU-timed (30 ms interval, 11+ ms steps); the first always is.
    assert steps[0]["dev"] == ["forward", "backward"] and 5 <= len(timed) <= STEPS // 2 and host
    for s in timed:  # GPU seconds from the events
        assert s["phases"]["forward"] == pytest.approx(FORWARD_GPU_S, rel=1e-6)
        assert s["phases"]["backward"] == pytest.approx(BACKWARD_GPU_S, rel=1e-6)
        assert "mem" in s  # the allocator is read on GPU-timed steps
    for s in host:  # host clock: the fake launches take no time
        assert s["phases"]["forward"] < FORWARD_GPU_S / 2 and "mem" not in s
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "classify", str(recording),
                             "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(line["step"] for line in lines[:-1]) == list(range(STEPS))
    assert lines[-1]["summary"]["steps"] == STEPS
