"""Agent cost on the fake NVML's 8×H100 node: CPU per collection cycle per GPU, /metrics.

Run from the repository root (builds the fake library with gcc)::

    .venv/bin/python benchmarks/bench_agent.py [--cycles 2000] [--scrapes 300]

1. Collection: NvmlSource.sample() in a child process that loads the fake
   libnvidia-ml.so.1 through the unmodified nvidia-ml-py binding, back to back, its clock
   advancing one 1 s interval per cycle (so GPM pairs are read every cycle and the slow set
   every tenth, as in the agent); CPU seconds per cycle and per GPU (process_time), against
   a baseline measured in the same child: the bare pynvml calls a minimal exporter would
   make for the same fields (no gpumon logic). bench_peers.py measures whole processes
   against the peers instead.
2. Scrape: a real agent subprocess; /metrics latency p50/p99 and body size, against
   /healthz on the same server in the same run (the HTTP floor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, SCENARIO, latencies

from gpumon.testing import agent_env, quantile, start_agent
from gpumon.testing.fakenvml import build_fake_nvml

_CHILD = """
import json, sys
import pynvml
from benchmarks.gpu_checks.nvml_probe import collection_cost
from gpumon.collectors import nvml
print(json.dumps(collection_cost(pynvml, nvml, int(sys.argv[1]), float("inf"))))
"""
"""The device script's own collection-cost measurement, here on the fake 8-GPU node."""


def collection(lib_dir: Path, cycles: int) -> dict[str, float]:
    """CPU per cycle of NvmlSource vs bare pynvml, in one child process."""
    env = agent_env(lib_dir, SCENARIO)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(cycles)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def scrape(lib_dir: Path, count: int) -> dict[str, float]:
    """/metrics vs /healthz latency on a running agent over the 8-GPU scenario."""
    with tempfile.TemporaryDirectory() as tmp:
        agent = start_agent(Path(tmp), "--interval", "1", env=agent_env(lib_dir, SCENARIO))
        try:
            time.sleep(2.5)  # let the slow set (processes, ECC) and GPM pairs arrive
            metrics, health = [], []
            size = 0
            for _ in range(5):
                m, size = latencies(agent.url + "/metrics", count // 5)
                h, _ = latencies(agent.url + "/healthz", count // 5)
                metrics += m
                health += h
        finally:
            agent.stop()
    return {
        "metrics_p50_s": statistics.median(metrics),
        "metrics_p99_s": quantile(metrics, 0.99),
        "healthz_p50_s": statistics.median(health),
        "healthz_p99_s": quantile(health, 0.99),
        "metrics_bytes": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--scrapes", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as build_dir:
        lib = build_fake_nvml(Path(build_dir))
        c = collection(lib.parent, args.cycles)
        s = scrape(lib.parent, args.scrapes)
    gpus = c["gpus"]
    rows = [
        ("collection CPU per cycle, 8 GPUs (gpumon)", f"{c['gpumon_cpu_s_per_cycle'] * 1e6:.0f} µs"),
        ("collection CPU per cycle per GPU (gpumon)", f"{c['gpumon_cpu_s_per_cycle'] / gpus * 1e6:.0f} µs"),
        ("bare pynvml, same fields, per cycle per GPU", f"{c['bare_cpu_s_per_cycle'] / gpus * 1e6:.0f} µs"),
        ("ratio gpumon / bare pynvml", f"{c['cpu_ratio_gpumon_to_bare']:.2f}×"),
        ("/metrics p50 / p99", f"{s['metrics_p50_s'] * 1e3:.2f} / {s['metrics_p99_s'] * 1e3:.2f} ms"),
        (
            "/healthz p50 / p99 (HTTP floor)",
            f"{s['healthz_p50_s'] * 1e3:.2f} / {s['healthz_p99_s'] * 1e3:.2f} ms",
        ),
        ("/metrics p50 ratio to /healthz", f"{s['metrics_p50_s'] / s['healthz_p50_s']:.1f}×"),
        ("/metrics size", f"{s['metrics_bytes'] / 1024:.1f} KiB"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, figure in rows:
        print(f"{name:<{width}}  {figure}")
    print(json.dumps({**c, **s}))


if __name__ == "__main__":
    main()
