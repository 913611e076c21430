"""Agent footprint: RSS over a simulated day of steps from 64 ranks, time compressed.

    .venv/bin/python benchmarks/bench_footprint.py [--ranks 64] [--step-seconds 20]
                                                   [--hours 24] [--rate 1000]

A real agent on the fake 8×H100 node (NVML every second) receives over its socket every step
of ``--ranks`` ranks for ``--hours`` simulated hours at ``--step-seconds`` a step (by default
4,320 steps per rank, 276,480 records), paced at ``--rate`` records/s (about 5 minutes), and
is scraped every 2 s meanwhile. The rate is 15 times a real job's (64 ranks at a step a
second) and about a quarter of what the agent's verdict engine can take: nearer its ceiling,
the queue of steps awaiting analysis grows with the machine's hiccups and the footprint
measures that backlog rather than the agent's state. Step k of every rank is stamped ``t0 + k × step``, so the
stamps run ahead of the wall clock; the agent takes a step that claims to end in the future
to have ended on receipt (analysis/stream.py), so each is analysed against the GPU samples
of its receipt window, as live steps are.

A twin agent runs beside it, on the same node and scraped alike, that receives no step: the
baseline of the same run. Some of an agent's memory fills with wall time whatever it is sent
(ten minutes of GPU samples per GPU), and a run of a few minutes is still filling it.

RSS (psutil) of both is sampled every second. Reported: before any step, after the first
simulated hour, at the middle and at the end, the peak, and the slope of a least-squares line
through the second half (MiB per simulated hour), with the records sent, accepted and dropped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import psutil
from common import build_peer_nvml, cpu_seconds, get, live_node, print_table, send_steps

from gpumon.testing import agent_env, parse_metrics, start_agent, values

MIB = 2**20


def _send(path: str, ranks: int, steps: int, step_s: float, rate: float,
          out: mp.Queue[tuple[int, int]]) -> None:
    out.put(send_steps(path, ranks, steps, step_s, time.time() - step_s, rate))


def main() -> None:
    """Run the simulated day and print the table and a JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--step-seconds", type=float, default=20.0)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--rate", type=float, default=1000.0, help="records sent per second")
    args = parser.parse_args()
    steps = int(args.hours * 3600 / args.step_seconds)

    with tempfile.TemporaryDirectory(prefix="gpumon-footprint") as tmp_name:
        tmp = Path(tmp_name)
        lib = build_peer_nvml(tmp / "lib")
        with live_node(tmp) as scenario:
            fed = start_agent(tmp, "--interval", "1", env=agent_env(lib.parent, scenario))
            idle = start_agent(tmp, "--interval", "1", env=agent_env(lib.parent, scenario))
            try:
                processes = [psutil.Process(fed.process.pid), psutil.Process(idle.process.pid)]
                time.sleep(5.0)  # first GPM pairs, slow NVML set, host sample
                before = [p.memory_info().rss for p in processes]
                cpu0 = cpu_seconds(fed.process.pid)
                results: mp.Queue[tuple[int, int]] = mp.Queue()
                sender = mp.get_context("fork").Process(
                    target=_send, args=(str(fed.socket_path), args.ranks, steps,
                                        args.step_seconds, args.rate, results))
                start = time.monotonic()
                sender.start()
                samples: list[tuple[float, int, int]] = []  # (seconds since start, RSS fed, idle)
                next_scrape = start
                while sender.is_alive():
                    now = time.monotonic()
                    if now >= next_scrape:  # a Prometheus scraping meanwhile
                        get(fed.url + "/metrics")
                        get(idle.url + "/metrics")
                        next_scrape = now + 2.0
                    fed_rss, idle_rss = (p.memory_info().rss for p in processes)
                    samples.append((now - start, fed_rss, idle_rss))
                    time.sleep(1.0)
                sending_s = time.monotonic() - start
                sent, lost = results.get()
                sender.join()
                cpu_s = cpu_seconds(fed.process.pid) - cpu0
                time.sleep(3.0)  # the agent's queue drains, the last steps are analysed
                metrics = parse_metrics(fed.scrape())
                after = [p.memory_info().rss for p in processes]
            finally:
                fed.stop()
                idle.stop()
    accepted = sum(values(metrics, "gpumon_ingest_records_total", kind="step"))
    dropped = sum(values(metrics, "gpumon_ingest_dropped_total"))

    def sim_hours(t: float) -> float:
        return t / sending_s * args.hours

    def at(hours: float) -> tuple[float, int, int]:
        return min(samples, key=lambda s: abs(sim_hours(s[0]) - hours))

    def slope(column: int) -> float:
        half = [(sim_hours(s[0]), s[column] / MIB) for s in samples
                if sim_hours(s[0]) >= args.hours / 2]
        return float(statistics.linear_regression([h for h, _ in half], [m for _, m in half])[0])

    def row(name: str, fed_rss: float, idle_rss: float) -> list[str]:
        return [name, f"{fed_rss / MIB:.1f} MiB", f"{idle_rss / MIB:.1f} MiB",
                f"{(fed_rss - idle_rss) / MIB:+.1f} MiB"]

    slopes = (slope(1), slope(2))
    rows = [
        row("before any step", *before),
        row("after 1 simulated hour", *at(1.0)[1:]),
        row(f"middle ({args.hours / 2:g} h)", *at(args.hours / 2)[1:]),
        row(f"end ({args.hours:g} h)", *samples[-1][1:]),
        row("peak", max(s[1] for s in samples), max(s[2] for s in samples)),
        row("3 s after the last step", *after),
        ["second-half slope, MiB per simulated hour", f"{slopes[0]:+.3f}", f"{slopes[1]:+.3f}",
         f"{slopes[0] - slopes[1]:+.3f}"],
        [f"second-half growth ({args.hours / 2:g} h)", f"{slopes[0] * args.hours / 2:+.2f} MiB",
         f"{slopes[1] * args.hours / 2:+.2f} MiB",
         f"{(slopes[0] - slopes[1]) * args.hours / 2:+.2f} MiB"],
    ]
    print(f"{args.ranks} ranks × {steps} steps of {args.step_seconds:g} s ({args.hours:g} h) = "
          f"{args.ranks * steps:,} records in {sending_s:.0f} s wall "
          f"({args.ranks * steps / sending_s:,.0f}/s), NVML every 1 s on 8 GPUs, scraped every 2 s")
    print_table(["agent RSS", "fed", "idle twin", "fed − idle"], rows)
    print(f"records sent {sent:,}, lost at the socket {lost:,}, accepted {accepted:,.0f}, "
          f"dropped by the agent {dropped:,.0f}; fed agent CPU {cpu_s:.1f} s "
          f"({cpu_s / max(accepted, 1) * 1e6:.0f} µs per record, "
          f"{cpu_s / sending_s:.0%} of a core while sending)")
    print(json.dumps({
        "benchmark": "footprint", "ranks": args.ranks, "steps_per_rank": steps,
        "step_seconds": args.step_seconds, "hours": args.hours, "sending_s": sending_s,
        "rss_before_bytes": before, "rss_end_bytes": samples[-1][1:],
        "rss_peak_bytes": [max(s[1] for s in samples), max(s[2] for s in samples)],
        "rss_after_bytes": after, "second_half_slope_mib_per_hour": slopes,
        "records_sent": sent, "records_lost": lost, "records_accepted": accepted,
        "records_dropped": dropped, "agent_cpu_s": cpu_s,
        "rss_samples": [(round(sim_hours(t), 3), fed_rss, idle_rss)
                        for t, fed_rss, idle_rss in samples],
    }))


if __name__ == "__main__":
    main()
