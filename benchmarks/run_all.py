"""Run every benchmark of benchmarks/RESULTS.md, one after another, and check the targets.

    .venv/bin/python benchmarks/run_all.py [--only peers,hook,...] [--quick]

Each script prints its own tables (shown as they come) and a JSON line last; this reads
the JSON lines and ends with one table: each target, the figure measured, met or missed.
Takes about 15 minutes (``--quick``: a tiny run of each, a few minutes); the peers' venv is
made on first use.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MB = 1e6

def case(result: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The row of bench_hook's results whose case starts with ``prefix`` (KeyError if absent:
    TensorBoard's row exists only with ``--tensorboard``)."""
    for row in result["results"]:
        if row["case"].startswith(prefix):
            return dict(row)
    raise KeyError(f"no {prefix!r} row in {[row['case'] for row in result['results']]}")


Check = tuple[str, Callable[[dict[str, Any]], float], Callable[[float], str], Callable[[float], bool]]
"""(target, figure from the JSON line, how to print it, whether it meets the target)."""

BENCHMARKS: dict[str, tuple[list[str], list[Check]]] = {
    "peers": (["bench_peers.py"], [
        ("collection: gpumon CPU per cycle ≤ 0.25× nvitop-exporter's",
         lambda r: r["cpu_per_cycle_s"]["gpumon"] / r["cpu_per_cycle_s"]["nvitop-exporter"],
         lambda x: f"{x:.3f}×", lambda x: x <= 0.25),
        ("scrape: gpumon /metrics p99 ≤ 10 ms (8 GPUs × 64 ranks)",
         lambda r: r["scrape"]["gpumon /metrics"]["p99_s"],
         lambda x: f"{x * 1e3:.2f} ms", lambda x: x <= 0.010),
    ]),
    "footprint": (["bench_footprint.py"], [
        ("footprint: peak RSS ≤ 80 MB over a simulated day of 64 ranks",
         lambda r: r["rss_peak_bytes"][0], lambda x: f"{x / MB:.1f} MB", lambda x: x <= 80 * MB),
        ("footprint: no growth over the second half (fed − idle twin ≤ 1 MiB)",
         lambda r: (r["second_half_slope_mib_per_hour"][0] - r["second_half_slope_mib_per_hour"][1])
         * r["hours"] / 2, lambda x: f"{x:+.2f} MiB", lambda x: x <= 1.0),
    ]),
    "hook": (["bench_hook.py", "--tensorboard"], [
        ("hook: ≤ 10 µs per step (training thread + sender)",
         lambda r: case(r, "loader")["total_us_per_step"], lambda x: f"{x:.2f} µs",
         lambda x: x <= 10.0),
        ("hook: ≤ 0.2× TensorBoard add_scalar for the same figures",
         lambda r: case(r, "loader")["total_us_per_step"] / case(r, "TensorBoard")["total_us_per_step"],
         lambda x: f"{x:.3f}×", lambda x: x <= 0.2),
        ("hook: the same on its pure-Python core, no C build (for reference)",
         lambda r: case(r, "the same, pure-Python")["total_us_per_step"] if r["hook_core"] == "c"
         else math.nan,
         lambda x: f"{x:.2f} µs", lambda x: x <= 10.0),
    ]),
    "train": (["bench_train.py"], [
        ("training: throughput with the hook ≥ 99% of without (median of block pairs)",
         lambda r: r["blocks_median_ratio"], lambda x: f"{x:.4f}", lambda x: x >= 0.99),
        ("training: the same, whole runs (median of run pairs; drift-bound, for reference)",
         lambda r: r["median_ratio"], lambda x: f"{x:.4f}", lambda x: x >= 0.99),
        ("training: control, the hook's with-blocks doing nothing (the floor, for reference)",
         lambda r: r["blocks_control_median_ratio"], lambda x: f"{x:.4f}", lambda x: x >= 0.99),
        ("training: the hook on its pure-Python core, no C build (for reference)",
         lambda r: r["blocks_python_median_ratio"] or math.nan, lambda x: f"{x:.4f}",
         lambda x: x >= 0.99),
    ]),
    "ingest": (["bench_ingest.py"], [
        ("ingest: ≥ 50,000 records/s offered with zero drops",
         lambda r: r["offered_zero_loss_per_s"], lambda x: f"{x:,.0f}/s",
         lambda x: x >= 50_000),
    ]),
    "fleet": (["bench_fleet.py"], [
        ("fleet: the store ingests every scraped series each scrape (ingest × interval ÷ series ≥ 0.9)",
         lambda r: r["load"]["ingest_samples_per_s"] * r["load"]["scrape_s"] / r["load"]["raw_series"],
         lambda x: f"{x:.2f}", lambda x: x >= 0.9),
        ("fleet: the run-level rule chain of the largest run evaluates within a 15 s interval",
         lambda r: r["ranks_per_run"][-1]["chain_s"], lambda x: f"{x:.2f} s", lambda x: x <= 15.0),
    ]),
    "run": (["bench_run.py"], [
        ("gpumon run: CPU example's throughput ≥ 99% of bare (mean over processes of block-round medians)",
         lambda r: r["cpu"]["run"], lambda x: f"{x:.4f}", lambda x: x >= 0.99),
        ("gpumon run: 2-rank DDP job's throughput ≥ 99% of plain (median of block rounds)",
         lambda r: r["ddp_in_process"]["run"], lambda x: f"{x:.4f}", lambda x: x >= 0.99),
        ("gpumon run: the DDP control, plain against plain (the floor, for reference)",
         lambda r: r["ddp_in_process"]["control"], lambda x: f"{x:.4f}", lambda x: x >= 0.99),
    ]),
    "trace": (["bench_trace.py"], [
        ("traces: no trace asked, throughput with the trace channel ≥ 99% of without",
         lambda r: r["idle_ratio"], lambda x: f"{x:.4f}", lambda x: x >= 0.99),
        ("traces: the same once traces were taken (the tracer attached, quiet)",
         lambda r: r["idle_ratio_after_trace"], lambda x: f"{x:.4f}", lambda x: x >= 0.99),
        ("traces: a traced step's time ÷ an untraced one's (measured, for reference)",
         lambda r: r["traced_ratio"], lambda x: f"{x:.2f}×", lambda x: True),
    ]),
}


QUICK: dict[str, list[str]] = {
    "peers": ["--rounds", "1", "--window", "1", "--warmup", "0.5", "--scrapes", "5", "--ranks", "2"],
    "footprint": ["--ranks", "2", "--hours", "0.1", "--rate", "8"],
    "hook": ["--blocks", "4", "--block-steps", "20"],
    "train": ["--pairs", "5", "--steps", "25", "--blocks", "5", "--block-steps", "2"],  # 20 warm-up steps
    "ingest": ["--seconds", "0.3", "--rates", "2000"],
    "fleet": ["--quick"],
    "trace": ["--blocks", "2", "--block-steps", "10", "--traces", "1"],
    "run": ["--processes", "1", "--blocks", "3", "--block-steps", "4", "--cpu-pairs", "1", "--turns", "2",
            "--ddp-rounds", "3", "--ddp-block-steps", "1", "--ddp-pairs", "1", "--ddp-steps", "1"],
}
"""Arguments for a tiny run of each benchmark (``--quick``): it starts, runs every part once
and prints its JSON line, so a broken benchmark shows in minutes; its figures mean nothing."""
PEERS_ONLY = "--tensorboard"
"""The flag that needs the peers' venv beside a benchmark that runs without it."""


def quick_script(name: str, with_peers: bool) -> list[str]:
    """The command line of ``name``'s tiny run; without the peers' venv, minus what needs it."""
    script, _ = BENCHMARKS[name]
    args = [a for a in script[1:] if with_peers or a != PEERS_ONLY]
    return [script[0], *args, *QUICK[name]]


def run(script: list[str]) -> dict[str, Any]:
    """Run one benchmark, echoing its output; its last JSON line."""
    proc = subprocess.Popen([sys.executable, str(HERE / script[0]), *script[1:]],
                            stdout=subprocess.PIPE, text=True)
    last: dict[str, Any] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            last = json.loads(line)
        else:
            print(line, end="", flush=True)
    if proc.wait() != 0:
        raise SystemExit(f"{script[0]} failed ({proc.returncode})")
    return last


def main() -> None:
    """Run the benchmarks and print the targets table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run of each (does every benchmark still run?); figures mean nothing")
    args = parser.parse_args()
    rows = []
    for name in args.only.split(","):
        script, checks = BENCHMARKS[name]
        if args.quick:
            script = quick_script(name, with_peers=True)
        print(f"\n=== {' '.join(script)}", flush=True)
        result = run(script)
        for target, figure, show, meets in checks:
            measured = figure(result)
            verdict = "quick run" if args.quick else "met" if meets(measured) else "MISSED"
            rows.append((target, show(measured), verdict))
    print()
    width = max(len(r[0]) for r in rows)
    for target, shown, verdict in rows:
        print(f"{target:<{width}}  {shown:>12}  {verdict}")


if __name__ == "__main__":
    main()
