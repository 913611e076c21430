"""Produce the labelled recordings in tests/data/<scenario>/ (run from the repository root).

    .venv/bin/python -m tests.data.make_recordings [--only NAME]

Each scenario runs a real agent with ``--record`` and a real workload reporting through the
real client hook, and writes ``recording.jsonl`` plus ``labels.json`` (the ground truth:
what the workload was made to be, decided before anything was classified).

- cpu_input_bound / cpu_not_input_bound: examples/train_cpu.py (a real PyTorch CPU loop)
  with and without a slow Dataset; no GPU, so the classifier works from phases alone.
- gpu_communication / gpu_memory_bandwidth / gpu_compute: a fake-NVML H100 whose counters
  show that regime (GPM SM/tensor/DRAM activity, NVLink traffic), and a job whose phases
  take the time such a job's phases take (sleeps inside the hook's real phase timers). The
  job's pid is in the fake GPU's process list, so the agent attributes it through NVML.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpumon.client import StepMonitor
from gpumon.testing.fakenvml import build_fake_nvml
from tests.helpers import ROOT, agent_env, start_agent

DATA = Path(__file__).resolve().parent
H100_PEAK = 989e12


@dataclass(frozen=True)
class GpuRegime:
    """What the fake GPU shows and how long the job's phases take."""

    name: str
    label: str
    gpm: dict[str, float]
    nvlink_kib_per_s: int
    phases_s: dict[str, float]
    mfu: float
    why: str


GPU_REGIMES = (
    GpuRegime(
        "gpu_communication", "communication",
        {"gpm_sm_util": 55, "gpm_sm_occupancy": 30, "gpm_tensor_util": 35, "gpm_dram_bw_util": 25},
        nvlink_kib_per_s=380_000_000,  # ~390 GB/s of 450: links near peak
        phases_s={"forward": 0.05, "backward": 0.08, "comm": 0.10, "optimizer": 0.02},
        mfu=0.18,
        why="exposed all-reduce takes 40% of each step while NVLink runs near peak",
    ),
    GpuRegime(
        "gpu_memory_bandwidth", "memory_bandwidth",
        {"gpm_sm_util": 88, "gpm_sm_occupancy": 45, "gpm_tensor_util": 12, "gpm_dram_bw_util": 82},
        nvlink_kib_per_s=2_000_000,
        phases_s={"forward": 0.08, "backward": 0.14, "comm": 0.005, "optimizer": 0.02},
        mfu=0.08,
        why="HBM bandwidth at 82% of peak with tensor cores mostly idle (unfused elementwise ops)",
    ),
    GpuRegime(
        "gpu_compute", "compute",
        {"gpm_sm_util": 93, "gpm_sm_occupancy": 60, "gpm_tensor_util": 72, "gpm_dram_bw_util": 35},
        nvlink_kib_per_s=2_000_000,
        phases_s={"forward": 0.08, "backward": 0.14, "comm": 0.005, "optimizer": 0.02},
        mfu=0.48,
        why="SMs and tensor cores saturated, MFU 0.48",
    ),
)


def _scenario(regime: GpuRegime, pid: int) -> str:
    lines = [
        "driver_version 550.54.15", "nvml_version 12.550.54.15", "gpu_count 1",
        "gpu 0 name NVIDIA H100 80GB HBM3",
        "gpu 0 uuid GPU-6a1e2c9d-3b47-4f08-9d1c-5e7b2a90f341",
        "gpu 0 util_gpu 97", "gpu 0 util_memory 60", "gpu 0 memory_used 61000000000",
        "gpu 0 nvlink_links 18",
        f"gpu 0 nvlink_tx_kib_per_s {regime.nvlink_kib_per_s}",
        f"gpu 0 nvlink_rx_kib_per_s {regime.nvlink_kib_per_s}",
        f"gpu 0 process {pid} 58000000000",
    ]
    lines += [f"gpu 0 {key} {value}" for key, value in regime.gpm.items()]
    return "\n".join(lines) + "\n"


def _write_labels(out: Path, label: str, why: str, source: str) -> None:
    (out / "labels.json").write_text(json.dumps(
        {"primary": label, "why": why, "source": source}, indent=2) + "\n")


def record_gpu(regime: GpuRegime, seconds: float) -> None:
    """A fake-NVML node in the regime, and a hooked job whose phases match it."""
    out = DATA / regime.name
    out.mkdir(exist_ok=True)
    recording = out / "recording.jsonl"
    recording.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_fake_nvml(Path(tmp) / "lib")
        scenario = Path(tmp) / "regime.scn"
        scenario.write_text(_scenario(regime, os.getpid()))
        agent = start_agent(Path(tmp), "--interval", "0.25", "--record", str(recording),
                            env=agent_env(lib.parent, scenario))
        try:
            mon = StepMonitor(run=regime.name, socket_path=str(agent.socket_path),
                              rank=0, world=1)
            step_s = sum(regime.phases_s.values())
            flops = regime.mfu * H100_PEAK * step_s
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                with mon.step(samples=64, tokens=64 * 2048, flops=flops):
                    for phase, duration in regime.phases_s.items():
                        with mon.phase(phase):
                            time.sleep(duration)
            mon.close()
            time.sleep(1.0)  # the last GPU samples after the last step
        finally:
            agent.stop()
    _write_labels(out, regime.label, regime.why, "fake NVML H100 + hooked job (sleeping phases)")


def record_cpu(name: str, input_bound: bool, steps: int) -> None:
    """examples/train_cpu.py, a real PyTorch CPU loop, with or without a slow Dataset."""
    out = DATA / name
    out.mkdir(exist_ok=True)
    recording = out / "recording.jsonl"
    recording.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        agent = start_agent(Path(tmp), "--interval", "0.25", "--record", str(recording),
                            "--collector", "host", "--collector", "ingest", env=agent_env())
        try:
            args = [sys.executable, "examples/train_cpu.py", "--steps", str(steps),
                    "--run", name, "--socket", str(agent.socket_path), "--threads", "1"]
            subprocess.run([*args, *(["--input-bound"] if input_bound else [])],
                           cwd=ROOT, check=True, capture_output=True)
            time.sleep(1.5)
        finally:
            agent.stop()
    if input_bound:
        _write_labels(out, "input", "a Dataset that sleeps per sample, num_workers=0",
                      "examples/train_cpu.py --input-bound")
    else:
        _write_labels(out, "not_input", "in-memory data: the step is forward/backward work",
                      "examples/train_cpu.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    jobs = {
        "cpu_input_bound": lambda: record_cpu("cpu_input_bound", True, 60),
        "cpu_not_input_bound": lambda: record_cpu("cpu_not_input_bound", False, 200),
        **{r.name: (lambda r=r: record_gpu(r, args.seconds)) for r in GPU_REGIMES},
    }
    for name, job in jobs.items():
        if args.only in (None, name):
            job()
            print(f"recorded {name}")


if __name__ == "__main__":
    main()
