"""Training throughput of examples/train_cpu.py with the hook against ``--no-hook``.

    python benchmarks/bench_train.py [--pairs 31] [--steps 300] [-- extra example args]

The example's ``main()`` runs again and again in this one process (torch imported once,
one intra-op thread), alternating hooked and bare runs and the order within each pair; each
run builds its model and data afresh and times its own steps after a warm-up. On a shared
machine throughput drifts by ±10 % over seconds: separate processes (2 s of torch import
each) compare runs far apart in time; runs of a second, back to back, compare neighbours.
The hooked runs report to a real Unix datagram socket drained by a reader process that
decodes every datagram as the agent would. Prints a table, the median of the pairs'
throughput ratios (and the ratio of the best run of each kind), and a JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
from pathlib import Path

from bench_hook import drained_socket  # the same socket drain as the hook benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from train_cpu import main as train  # noqa: E402


def run(socket_path: str, hook: bool, steps: int, extra: list[str]) -> float:
    """Samples per second of one run of the example."""
    argv = ["--steps", str(steps), "--warmup", "20", "--threads", "1",
            "--run", "bench-train", "--socket", socket_path, *extra]
    if not hook:
        argv.append("--no-hook")
    with contextlib.redirect_stdout(io.StringIO()):  # its summary line: returned below
        summary = train(argv)
    if hook and summary["dropped"]:
        raise RuntimeError(f"the hooked run dropped records: {summary['dropped']}")
    return float(summary["samples_per_second"])


def main() -> None:
    """Run the pairs and print the table and JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=31)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("extra", nargs="*", help="more arguments for the example")
    args = parser.parse_args()
    if args.pairs < 5:
        parser.error("--pairs must be at least 5")

    rows = []
    with drained_socket() as (path, finish):
        run(path, False, args.steps, args.extra)  # warm the allocator and kernels up
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            result = {hook: run(path, hook, args.steps, args.extra) for hook in order}
            rows.append((result[True], result[False], result[True] / result[False]))
        received = finish()

    print(f"{'pair':>4} {'hook samples/s':>15} {'no-hook samples/s':>18} {'ratio':>7}")
    for i, (hooked, bare, ratio) in enumerate(rows):
        print(f"{i:4d} {hooked:15.1f} {bare:18.1f} {ratio:7.4f}")
    ratios = sorted(r[2] for r in rows)
    median_ratio = statistics.median(ratios)
    quartiles = statistics.quantiles(ratios, n=4)
    hooked_median = statistics.median(r[0] for r in rows)
    bare_median = statistics.median(r[1] for r in rows)
    # The best run of each kind is the least disturbed by other load on the machine.
    best_ratio = max(r[0] for r in rows) / max(r[1] for r in rows)
    print(f"median: hook {hooked_median:.1f}, no-hook {bare_median:.1f}, ratio {median_ratio:.4f} "
          f"(quartiles {quartiles[0]:.4f}–{quartiles[2]:.4f})")
    print(f"best run of each: ratio {best_ratio:.4f}")
    print(f"records received by the reader: {received} (expected {args.pairs * (args.steps + 1)})")
    print(
        json.dumps(
            {
                "benchmark": "train",
                "pairs": args.pairs,
                "steps": args.steps,
                "extra_args": args.extra,
                "hook_samples_per_second_median": hooked_median,
                "no_hook_samples_per_second_median": bare_median,
                "median_ratio": median_ratio,
                "ratio_quartiles": [quartiles[0], quartiles[2]],
                "best_ratio": best_ratio,
                "ratios": [r[2] for r in rows],
                "records_received": received,
            }
        )
    )


if __name__ == "__main__":
    main()
