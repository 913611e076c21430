"""gpumon against nvitop-exporter and gpustat on the same fake 8×H100 node: CPU and scrapes.

    .venv/bin/python benchmarks/bench_peers.py [--rounds 5] [--window 10] [--interval 0.25]
                                               [--scrapes 300] [--ranks 64] [--soak 600]

Every collector loads the same library: the fake NVML (gpumon/testing/fakenvml) compiled together
with peer_nvml_stubs.c (entry points the peers call and the fake lacks), with the
h100_8x_live scenario. The peers come from PyPI into benchmarks/.peers-venv.

1. Collection: each collector runs alone as a real process (gpumon's agent, the
   nvitop-exporter command, gpustat.new_query() in a loop), at the same interval, in
   rounds whose order rotates. Its CPU time (every thread, from the scheduler) is read
   over a fixed wall window after a warm-up; its cycles are counted by counted.py, which
   wraps each collector's per-cycle function. Medians over the rounds. The window covers
   everything the process does: gpumon's host (5 s) and slow NVML set (10 s), nvitop's
   host metrics (every cycle).
2. Scrape: the three run side by side, gpumon receiving ``--ranks`` ranks of live steps
   over its socket; ``/metrics`` of gpumon and nvitop-exporter and a `gpustat --json` per
   GET (a tenth as many: each takes 0.8 s) are timed in rotation, with gpumon's /healthz
   as the HTTP floor.
3. Soak (``--soak S``): gpumon alone at a 1 s interval, fed ``--soak-ranks`` ranks of live
   steps (8: one rank a GPU), scraped once a second for S seconds as Prometheus would, with
   /healthz half a second after each as the HTTP floor; the scrapes' p50/p99/max and the
   agent's RSS (at every scrape: the largest and the last).
Prints the tables, what each covers, the targets' figures of this one run side by side, and a
JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from common import (
    ROOT,
    build_peer_nvml,
    get,
    latencies,
    live_node,
    peers_python,
    print_table,
    send_steps,
    thread_cpu_ns,
    thread_names,
)
from counted import read_count

from gpumon.testing import (
    AgentProcess,
    agent_env,
    free_port,
    http_get,
    parse_metrics,
    quantile,
    wait_for,
)

COUNTED = str(Path(__file__).resolve().parent / "counted.py")
COLLECTORS = ("gpumon", "nvitop-exporter", "gpustat", "idle-loop")
SCRAPED = COLLECTORS[:3]


@dataclass
class Running(AgentProcess):
    """One collector process (stopped, and gpumon's scraped, as the tests' agents are) and
    its cycle count."""

    name: str = ""
    count_file: str = ""

    def cycles(self) -> int:
        return read_count(self.count_file)

    def rss_bytes(self) -> int:
        return int(psutil.Process(self.process.pid).memory_info().rss)


def start(name: str, lib: Path, scenario: Path, tmp: Path, interval_s: float,
          serve: bool = False) -> Running:
    """Start one collector; with ``serve`` gpustat answers `gpustat --json` per GET instead."""
    port = free_port()
    count_file = str(tmp / f"{name}-{port}.count")
    socket_path = tmp / f"ingest-{port}.sock"
    if name == "gpumon":
        args = [sys.executable, COUNTED, count_file, "gpumon", "--address", "127.0.0.1",
                "--port", str(port), "--socket", str(socket_path),
                "--interval", str(interval_s), "--log-level", "warning"]
    elif name == "nvitop-exporter":
        args = [str(peers_python()), COUNTED, count_file, "nvitop-exporter", "--hostname",
                "bench", "--bind-address", "127.0.0.1", "--port", str(port),
                "--interval", str(interval_s)]
    else:
        mode = ["--serve", str(port)] if serve else ["--interval", str(interval_s)]
        args = [str(peers_python()), COUNTED, count_file, name, *mode]
    log_path = tmp / f"{name}-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                   env=agent_env(lib.parent, scenario), cwd=ROOT)
    running = Running(process, port, socket_path, log_path, name, count_file)
    probe = running.url + "/readyz" if name == "gpumon" else (running.url if serve else None)

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"{name} exited:\n{running.log()}")
        if probe is not None:
            return http_get(probe)[0] == 200
        return Path(count_file).exists() and running.cycles() > 0

    try:
        wait_for(ready, timeout=60, what=f"{name} to start")
    except BaseException:
        running.stop()
        raise
    return running


def collection(lib: Path, scenario: Path, tmp: Path, rounds: int, window_s: float,
               interval_s: float, warmup_s: float) -> dict[str, list[dict[str, Any]]]:
    """Per collector, one measurement per round: CPU per cycle (and per thread), cycles, RSS."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in COLLECTORS}
    for r in range(rounds):
        order = COLLECTORS[r % len(COLLECTORS):] + COLLECTORS[:r % len(COLLECTORS)]
        for name in order:
            running = start(name, lib, scenario, tmp, interval_s)
            try:
                time.sleep(warmup_s)
                pid = running.process.pid
                cycles0, threads0, t0 = running.cycles(), thread_cpu_ns(pid), time.monotonic()
                time.sleep(window_s)
                cycles1, threads1, t1 = running.cycles(), thread_cpu_ns(pid), time.monotonic()
                rss = running.rss_bytes()
                names = thread_names(pid)
            finally:
                running.stop()
            cycles = max(cycles1 - cycles0, 1)
            per_thread: dict[str, float] = {}
            for tid, ns in threads1.items():
                thread = names.get(tid, "other")
                per_thread[thread] = per_thread.get(thread, 0.0) + (ns - threads0.get(tid, 0)) / 1e9
            cpu_s = sum(per_thread.values())
            results[name].append({
                "cpu_s": cpu_s, "wall_s": t1 - t0, "cycles": cycles1 - cycles0,
                "expected_cycles": (t1 - t0) / interval_s, "cpu_per_cycle_s": cpu_s / cycles,
                "rss_bytes": rss, "thread_cpu_per_cycle_s": {
                    thread: seconds / cycles for thread, seconds in per_thread.items()},
            })
            print(f"round {r} {name:16} {cycles1 - cycles0:4d} cycles, "
                  f"{cpu_s / cycles * 1e3:7.2f} ms CPU per cycle", file=sys.stderr)
    return results


def _feed(path: str, ranks: int, step_s: float, seconds: float) -> None:
    steps = int(seconds / step_s)
    send_steps(path, ranks, steps, step_s, time.time() - step_s, ranks / step_s)


def scrape(lib: Path, scenario: Path, tmp: Path, scrapes: int, ranks: int, interval_s: float,
           ) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Latency and size of a scrape of each collector, gpumon fed ``ranks`` ranks of steps."""
    running: dict[str, Running] = {}
    feeder = None
    try:
        for name in SCRAPED:
            running[name] = start(name, lib, scenario, tmp, interval_s, serve=True)
        gpumon = running["gpumon"]
        step_s = 0.5
        feeder = mp.get_context("fork").Process(
            target=_feed, args=(str(gpumon.socket_path), ranks, step_s, 3600.0), daemon=True)
        feeder.start()

        def every_rank_has_a_verdict() -> bool:
            text = get(f"{gpumon.url}/metrics").decode()
            return text.count("gpumon_step_bottleneck_confidence{") >= ranks

        wait_for(every_rank_has_a_verdict, timeout=60, what="a verdict for every rank")
        targets: dict[str, str] = {
            "gpumon /metrics": f"{gpumon.url}/metrics",
            "nvitop-exporter /metrics": f"{running['nvitop-exporter'].url}/metrics",
            "gpustat --json (on demand)": running["gpustat"].url,
            "gpumon /healthz (HTTP floor)": f"{gpumon.url}/healthz",
        }
        times: dict[str, list[float]] = {name: [] for name in targets}
        sizes: dict[str, int] = {}
        names = list(targets)
        for r in range(10):
            for name in names[r % len(names):] + names[:r % len(names)]:
                # A gpustat query sleeps 0.1 s per GPU: a tenth as many of those.
                count = max(1, scrapes // (100 if name.startswith("gpustat") else 10))
                t, sizes[name] = latencies(targets[name], count)
                times[name] += t
        bodies = {name: get(url).decode() for name, url in targets.items()}
    finally:
        if feeder is not None:
            feeder.kill()
        for proc in running.values():
            proc.stop()
    stats = {name: {"p50_s": statistics.median(t), "p99_s": quantile(t, 0.99),
                    "bytes": sizes[name]} for name, t in times.items()}
    return stats, bodies


def soak(lib: Path, scenario: Path, tmp: Path, seconds: float, ranks: int) -> dict[str, Any]:
    """gpumon fed ``ranks`` ranks of steps and scraped once a second for ``seconds``."""
    gpumon = start("gpumon", lib, scenario, tmp, 1.0)
    feeder = mp.get_context("fork").Process(
        target=_feed, args=(str(gpumon.socket_path), ranks, 0.5, seconds + 120.0), daemon=True)
    feeder.start()
    try:
        def every_rank_has_a_verdict() -> bool:
            text = get(f"{gpumon.url}/metrics").decode()
            return text.count("gpumon_step_bottleneck_confidence{") >= ranks

        wait_for(every_rank_has_a_verdict, timeout=60, what="a verdict for every rank")
        times: list[float] = []
        floor: list[float] = []  # /healthz half a second later: this machine's HTTP floor
        rss: list[int] = []
        size = 0
        next_t = time.monotonic()
        end = next_t + seconds
        while next_t < end:
            time.sleep(max(next_t - time.monotonic(), 0.0))
            t, size = latencies(f"{gpumon.url}/metrics", 1)
            times += t
            rss.append(gpumon.rss_bytes())
            time.sleep(max(next_t + 0.5 - time.monotonic(), 0.0))
            floor += latencies(f"{gpumon.url}/healthz", 1)[0]
            next_t += 1.0
    finally:
        feeder.kill()
        gpumon.stop()
    return {"seconds": seconds, "scrapes": len(times), "p50_s": statistics.median(times),
            "p99_s": quantile(times, 0.99), "max_s": max(times), "bytes": size,
            "healthz_p50_s": statistics.median(floor), "healthz_p99_s": quantile(floor, 0.99),
            "rss_max_bytes": max(rss), "rss_last_bytes": rss[-1]}


def _samples(text: str) -> list[tuple[str, dict[str, str]]]:
    return [(name, dict(labels)) for name, labels in parse_metrics(text)]


def coverage(bodies: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Series per GPU (and in all) in each scrape, and the metric names for one GPU."""
    out: dict[str, dict[str, Any]] = {}
    for name, gpu_label in (("gpumon /metrics", "gpu"), ("nvitop-exporter /metrics", "index")):
        samples = _samples(bodies[name])
        gpu0 = [n for n, labels in samples if labels.get(gpu_label) == "0"
                and "rank" not in labels]
        out[name.split()[0]] = {
            "series_total": len(samples),
            "series_gpu0": len(gpu0),
            "series_per_rank": sum(1 for _, labels in samples if labels.get("rank") == "0"),
            "metrics_gpu0": sorted(set(gpu0)),
        }
    gpu = json.loads(bodies["gpustat --json (on demand)"])["gpus"][0]
    out["gpustat"] = {"series_gpu0": len(gpu), "metrics_gpu0": sorted(gpu)}
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(row[key] for row in rows))


def _thread_medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median CPU per cycle of each thread over the rounds, busiest first."""
    names = {thread for row in rows for thread in row["thread_cpu_per_cycle_s"]}
    medians = {thread: statistics.median(row["thread_cpu_per_cycle_s"].get(thread, 0.0)
                                         for row in rows) for thread in names}
    return dict(sorted(medians.items(), key=lambda item: -item[1]))


def main() -> None:
    """Run both parts and print the tables and a JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before the window")
    parser.add_argument("--interval", type=float, default=0.25,
                        help="collection interval (nvitop-exporter's minimum is 0.25)")
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--soak", type=float, default=0.0,
                        help="seconds of one scrape a second (0: none)")
    parser.add_argument("--soak-ranks", type=int, default=8,
                        help="ranks of live steps fed during the soak")
    args = parser.parse_args()
    peers_python()
    with tempfile.TemporaryDirectory(prefix="gpumon-peers") as tmp_name:
        tmp = Path(tmp_name)
        lib = build_peer_nvml(tmp / "lib")
        with live_node(tmp) as scenario:
            cpu = collection(lib, scenario, tmp, args.rounds, args.window, args.interval,
                             args.warmup)
            scrape_stats, bodies = scrape(lib, scenario, tmp, args.scrapes, args.ranks, 1.0)
            soaked = soak(lib, scenario, tmp, args.soak, args.soak_ranks) if args.soak else None
    cover = coverage(bodies)

    gpus = 8
    per_cycle = {name: _median(rows, "cpu_per_cycle_s") for name, rows in cpu.items()}
    base = per_cycle["gpumon"]
    print(f"\nCollection, 8 GPUs, every {args.interval} s, {args.rounds} rounds of "
          f"{args.window:.0f} s (median)")
    print_table(
        ["collector", "CPU/cycle", "CPU/cycle/GPU", "× gpumon", "cycles counted/expected",
         "CPU % of a core", "RSS"],
        [[name, f"{per_cycle[name] * 1e3:.2f} ms", f"{per_cycle[name] / gpus * 1e6:.0f} µs",
          f"{per_cycle[name] / base:.2f}",
          f"{_median(rows, 'cycles'):.0f}/{_median(rows, 'expected_cycles'):.0f}",
          f"{_median(rows, 'cpu_s') / _median(rows, 'wall_s') * 100:.2f} %",
          f"{_median(rows, 'rss_bytes') / 2**20:.0f} MiB"]
         for name, rows in cpu.items()])
    print(f"gpumon / nvitop-exporter CPU per cycle: {base / per_cycle['nvitop-exporter']:.3f}×; "
          f"gpumon / gpustat: {base / per_cycle['gpustat']:.3f}×")
    print("idle-loop: a Python loop that wakes on the same ticks and does nothing (this "
          "machine's cost of one wakeup)")
    for name in ("gpumon", "nvitop-exporter"):
        threads = _thread_medians(cpu[name])
        print(f"{name} CPU per cycle by thread: " + ", ".join(
            f"{thread} {seconds * 1e3:.2f} ms" for thread, seconds in threads.items()))

    print(f"\nScrape, 8 GPUs, gpumon fed {args.ranks} ranks of live steps "
          f"({args.scrapes} requests each, in rotation)")
    print_table(
        ["endpoint", "p50", "p99", "size", "p99 × gpumon"],
        [[name, f"{s['p50_s'] * 1e3:.2f} ms", f"{s['p99_s'] * 1e3:.2f} ms",
          f"{s['bytes'] / 1024:.1f} KiB",
          f"{s['p99_s'] / scrape_stats['gpumon /metrics']['p99_s']:.2f}"]
         for name, s in scrape_stats.items()])

    print("\nCoverage (series for GPU 0 in one scrape; gpustat: JSON fields of GPU 0)")
    for name, c in cover.items():
        extra = (f", {c['series_total']} series in all, {c['series_per_rank']} per rank"
                 if "series_total" in c else "")
        print(f"{name}: {c['series_gpu0']} for GPU 0{extra}")
        print(f"    {', '.join(str(m) for m in c['metrics_gpu0'])}")  # type: ignore[attr-defined]
    if soaked is not None:
        print(f"\nSoak: gpumon fed {args.soak_ranks} ranks, /metrics once a second for "
              f"{soaked['seconds']:.0f} s ({soaked['scrapes']} scrapes, "
              f"{soaked['bytes'] / 1024:.0f} KiB each)")
        print_table(["p50", "p99", "max", "/healthz p50 / p99", "RSS max", "RSS last"], [[
            f"{soaked['p50_s'] * 1e3:.2f} ms", f"{soaked['p99_s'] * 1e3:.2f} ms",
            f"{soaked['max_s'] * 1e3:.2f} ms",
            f"{soaked['healthz_p50_s'] * 1e3:.2f} / {soaked['healthz_p99_s'] * 1e3:.2f} ms",
            f"{soaked['rss_max_bytes'] / 1e6:.1f} MB", f"{soaked['rss_last_bytes'] / 1e6:.1f} MB"]])
    print("\nThis run's figures for the agent's targets")
    rss_mb = _median(cpu["gpumon"], "rss_bytes") / 1e6
    rows = [["collection CPU per cycle, gpumon / nvitop-exporter (≤ 0.25×)",
             f"{base / per_cycle['nvitop-exporter']:.3f}× ({base * 1e3:.2f} vs "
             f"{per_cycle['nvitop-exporter'] * 1e3:.2f} ms)"],
            ["gpumon RSS, collecting (≤ 40 MB)", f"{rss_mb:.1f} MB"]]
    if soaked is not None:
        rows += [[f"gpumon RSS, fed {args.soak_ranks} ranks, largest over the soak (≤ 40 MB)",
                  f"{soaked['rss_max_bytes'] / 1e6:.1f} MB"],
                 [f"/metrics p99, a scrape a second, {args.soak_ranks} ranks (≤ 10 ms)",
                  f"{soaked['p99_s'] * 1e3:.2f} ms over {soaked['scrapes']} scrapes "
                  f"(/healthz p99 {soaked['healthz_p99_s'] * 1e3:.2f} ms)"]]
    print_table(["target", "this run"], rows)
    print(json.dumps({"benchmark": "peers", "interval_s": args.interval,
                      "cpu_per_cycle_s": per_cycle, "collection_rounds": cpu,
                      "scrape": scrape_stats, "soak": soaked, "coverage": cover}))


if __name__ == "__main__":
    main()
