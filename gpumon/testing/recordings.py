"""Recordings made to measure: a synchronous data-parallel run with known phases, one rank
that does more work than its peers (who wait for it in the all-reduce), peaks that grow towards
the device's memory, and GPU samples, written in the recording format (docs/architecture.md
§6). The report's tests compare its figures with these numbers; the benchmark writes a day of
64 ranks with it."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
CAPACITY = 80 * GIB


@dataclass(frozen=True)
class Run:
    """What the recording holds."""

    run: str = "llm"
    ranks: int = 3
    steps: int = 120
    step_s: float = 0.4
    straggler: int | None = 2
    """This rank computes 0.7 of the step where its peers compute 0.4 and wait the rest."""
    t0: float = 1_700_000_000.0
    gpu_every_s: float = 1.0
    peak_growth: float = 32 * 2**20
    """Bytes each step adds to every rank's peak (towards ``CAPACITY``)."""
    seed: int = 7
    gpus_active: bool = True
    """False: every GPU sample reads no activity and no traffic (a node whose GPUs the job
    never used)."""
    times: bool = False
    """Whether the recording ends with each rank's time line (``time_figures``), as the
    agent writes at its stop; without, a recording made before the agent accounted time."""


def step_line(run: Run, rank: int, step: int, rng: random.Random) -> dict[str, object]:
    """One rank's step: phases in fractions of the step, jittered by a percent."""
    d = run.step_s * (1 + rng.uniform(-0.01, 0.01))
    compute = 0.7 if rank == run.straggler else 0.4
    forward, backward = 0.3 * compute * d, 0.7 * compute * d
    data, optimizer, other = 0.1 * d, 0.1 * d, 0.05 * d
    wait = d - data - forward - backward - optimizer - other
    peak = int(40 * GIB + step * run.peak_growth)
    line: dict[str, object] = {
        "v": 1, "kind": "step", "run": run.run, "rank": rank, "world": run.ranks,
        "local_rank": rank % 8, "step": step, "t_start": run.t0 + step * run.step_s,
        "duration": d, "gpu": rank % 8,
        "phases": {"data": data, "forward": forward, "backward": backward + wait,
                   "optimizer": optimizer},
        "comm": {"exposed": wait, "busy": wait + 0.1 * d,
                 "ops": {"all_reduce": [1, 256 * 2**20, wait + 0.1 * d]}},
        "samples": 32, "tokens": 32 * 2048, "flops": 4e14 * d,
        "mem": {"allocated": peak - 4 * GIB, "reserved": peak + GIB, "peak": peak,
                "retries": 0, "ooms": 0},
    }
    if step % 10 == 0:
        line["memb"] = {"parameters": 8 * GIB, "gradients": 8 * GIB,
                        "optimizer_states": 16 * GIB, "activations": 6 * GIB,
                        "other": peak - 38 * GIB}
    return line


IDLE_ZERO = (  # what an idle GPU reads as 0
    "utilization", "memory_utilization", "sm_active", "sm_occupancy", "tensor_active",
    "dram_active", "nvlink_tx_bytes_per_second", "nvlink_rx_bytes_per_second",
    "pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second")


def gpu_line(run: Run, gpu: int, t: float) -> dict[str, object]:
    line: dict[str, object] = {
        "kind": "gpu", "t": t, "gpu": gpu, "uuid": f"GPU-{gpu}", "model": "NVIDIA H100",
        "utilization": 0.9, "memory_utilization": 0.5, "memory_used_bytes": 50 * GIB,
        "memory_total_bytes": CAPACITY, "sm_active": 0.7, "sm_occupancy": 0.4,
        "tensor_active": 0.5, "dram_active": 0.3, "nvlink_tx_bytes_per_second": 5e10,
        "nvlink_rx_bytes_per_second": 5e10, "pcie_tx_bytes_per_second": 2e9,
        "pcie_rx_bytes_per_second": 2e9, "power_watts": 500.0}
    if not run.gpus_active:  # busy nowhere, no traffic, an idle GPU's power
        line.update(dict.fromkeys(IDLE_ZERO, 0.0), memory_used_bytes=0, power_watts=70.0)
    return line


def time_figures(run: Run, rank: int) -> dict[str, object]:
    """The rank's time line, as the agent writes it at its stop (``agent/recorder.py``), in
    round shares of the run's span: rank 1 (where there is one) failed half-way, lost its
    unsaved steps and was restarted."""
    span = run.steps * run.step_s
    badput = {"startup": 2.0 + rank, "checkpoint": round(0.05 * span, 3), "evaluation": 0.0,
              "stalled": 0.0, "lost": 0.0, "restart": 0.0, "other": round(0.03 * span, 3)}
    restarted: list[float] = []
    if rank == 1:
        badput.update(lost=round(0.1 * span, 3), restart=3.0)
        restarted = [round(run.t0 + span / 2, 3)]
    return {"kind": "time", "t": round(run.t0 + span + 1.0, 3), "run": run.run, "rank": rank,
            "goodput": round(0.8 * span, 3), "badput": badput, "unsaved": round(0.02 * span, 3),
            "restarts": len(restarted), "restarted_at": restarted}


def lines(run: Run) -> Iterator[dict[str, object]]:
    """The recording's lines in time order, as an agent appends them."""
    rng = random.Random(run.seed)
    gpus = min(run.ranks, 8)
    next_gpu_t = run.t0
    for step in range(run.steps):
        end = run.t0 + (step + 1) * run.step_s
        while next_gpu_t <= end:
            for gpu in range(gpus):
                yield gpu_line(run, gpu, next_gpu_t)
            next_gpu_t += run.gpu_every_s
        for rank in range(run.ranks):
            yield step_line(run, rank, step, rng)
    if run.times:
        for rank in range(run.ranks):
            yield time_figures(run, rank)


def write(path: Path, run: Run) -> Path:
    """Write the recording; returns ``path``."""
    with open(path, "w", encoding="utf-8") as out:
        for line in lines(run):
            out.write(json.dumps(line, separators=(",", ":")) + "\n")
    return path
