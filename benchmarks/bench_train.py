"""Training throughput of examples/train_cpu.py with the hook against ``--no-hook``.

    python benchmarks/bench_train.py [--pairs 31] [--steps 300] [--blocks 201] [--block-steps 50]
                                     [-- extra example args]

Two ways, both in this one process (torch imported once, one intra-op thread), alternating
hooked and bare and the order within each pair:

- runs: the example's ``main()`` again and again, each run building its model and data
  afresh and timing its own steps after a warm-up (``--pairs`` pairs of ``--steps`` steps);
- blocks: one model, one monitor; blocks of ``--block-steps`` steps through the example's
  own ``train()``: bare, hooked, and a control with the hook's shape but none of its work
  (``--blocks`` rounds of the three). A hooked block ends with a synchronous flush of its
  records, timed with it, so everything the sender does for its steps is billed to it and
  none to the bare block after it. The control's ratio is this machine's floor: what any
  Python at the hook's points of the loop costs here.

On a shared machine throughput drifts by ±10 % over seconds: runs of a second compare
neighbours a second apart, blocks of ~0.2 s neighbours a fifth of that, which is why the
blocks resolve a 1 % difference and the runs do not. The hooked steps report to a real Unix
datagram socket drained by a reader process that receives and decodes every datagram as the
agent would. Prints a table for each, the medians of the pairs' throughput ratios, and a
JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from bench_hook import drained_socket  # the same socket drain as the hook benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from common import pure_python_step_monitor  # noqa: E402
from train_cpu import main as train_main  # noqa: E402
from train_cpu import make_job, parse_args, train  # noqa: E402

from gpumon.client import StepMonitor  # noqa: E402
from gpumon.client.monitor import IMPLEMENTATION  # noqa: E402
from gpumon.client.watchers.memory import INTERVAL_ENV, watch_memory  # noqa: E402

T = TypeVar("T")


def run(socket_path: str, hook: bool, steps: int, extra: list[str]) -> float:
    """Samples per second of one run of the example."""
    argv = ["--steps", str(steps), "--warmup", "20", "--threads", "1",
            "--run", "bench-train", "--socket", socket_path, *extra]
    if not hook:
        argv.append("--no-hook")
    with contextlib.redirect_stdout(io.StringIO()):  # its summary line: returned below
        summary = train_main(argv)
    if hook and summary["dropped"]:
        raise RuntimeError(f"the hooked run dropped records: {summary['dropped']}")
    return float(summary["samples_per_second"])


class StructureOnly:
    """The hook's shape without its work: the same loader wrapper and ``with`` blocks, doing
    nothing. Its ratio to bare is what this machine charges for any Python at those points of
    the loop (caches the step's kernels evicted): the floor under the hook's own cost."""

    def loader(self, iterable: Iterable[T]) -> Iterator[T]:
        yield from iterable

    def step(self, **_: object) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def phase(self, _name: str) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


def block_pairs(socket_path: str, blocks: int, block_steps: int, extra: list[str]) -> dict[str, list[float]]:
    """Throughput ratios against bare blocks of one job (bare / other step time) of the
    hooked blocks and of the ``StructureOnly`` control, ``blocks`` rounds in rotating order."""
    job = make_job(parse_args(["--threads", "1", *extra]))
    monitors = {"hooked": StepMonitor("bench-train-blocks", socket_path=socket_path)}
    if IMPLEMENTATION == "c":  # the pure-Python core too: the C core's before, in this run
        monitors["hooked_python"] = pure_python_step_monitor()("bench-train-python", socket_path=socket_path)
    # The memory breakdown watched: sampled every 5 s (the default), and on every step, whose
    # difference to "hooked" is what one sampled breakdown costs.
    for kind, interval in (("hooked_memory", None), ("memory_every_step", "0")):
        monitor = StepMonitor(f"bench-train-{kind.replace('_', '-')}", socket_path=socket_path)
        with _sample_interval(interval):
            watch_memory(monitor, job.model, job.optimizer)
        monitors[kind] = monitor
    control = StructureOnly()

    def seconds_per_step(kind: str) -> float:
        t0 = time.perf_counter()
        monitor = monitors.get(kind)
        if monitor is not None:
            train(job, block_steps, monitor)
            monitor.flush()
        else:
            train(job, block_steps, control if kind == "control" else None)  # type: ignore[arg-type]
        return (time.perf_counter() - t0) / block_steps

    kinds = ["bare", *monitors, "control"]
    for kind in kinds:  # warm every path up
        seconds_per_step(kind)
    ratios: dict[str, list[float]] = {kind: [] for kind in kinds if kind != "bare"}
    ratios["sampled_breakdown_us"] = []
    for i in range(blocks):
        shift = i % len(kinds)
        result = {kind: seconds_per_step(kind) for kind in kinds[shift:] + kinds[:shift]}
        for kind in kinds:
            if kind != "bare":
                ratios[kind].append(result["bare"] / result[kind])  # throughput: the inverse
        ratios["sampled_breakdown_us"].append(
            (result["memory_every_step"] - result["hooked"]) * 1e6)
    for monitor in monitors.values():
        monitor.close()
        if monitor.stats.dropped:
            raise RuntimeError(f"the hooked blocks dropped records: {monitor.stats.dropped}")
    return ratios


@contextlib.contextmanager
def _sample_interval(seconds: str | None) -> Iterator[None]:
    """``GPUMON_MEMORY_SAMPLE_S`` set (or left to its default, ``None``) while a sampler is made."""
    old = os.environ.pop(INTERVAL_ENV, None)
    if seconds is not None:
        os.environ[INTERVAL_ENV] = seconds
    try:
        yield
    finally:
        os.environ.pop(INTERVAL_ENV, None)
        if old is not None:
            os.environ[INTERVAL_ENV] = old


def main() -> None:
    """Run the pairs and print the table and JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=31)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=201)
    parser.add_argument("--block-steps", type=int, default=50)
    parser.add_argument("extra", nargs="*", help="more arguments for the example")
    args = parser.parse_args()
    if args.pairs < 5 or args.blocks < 5:
        parser.error("--pairs and --blocks must be at least 5")

    rows = []
    with drained_socket() as (path, finish):
        run(path, False, args.steps, args.extra)  # warm the allocator and kernels up
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            result = {hook: run(path, hook, args.steps, args.extra) for hook in order}
            rows.append((result[True], result[False], result[True] / result[False]))
        blocks = block_pairs(path, args.blocks, args.block_steps, args.extra)
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
    block_median = statistics.median(blocks["hooked"])
    block_quartiles = statistics.quantiles(blocks["hooked"], n=4)
    control_median = statistics.median(blocks["control"])
    control_quartiles = statistics.quantiles(blocks["control"], n=4)
    print(f"blocks: {args.blocks} rounds of {args.block_steps} steps, median ratio to bare: hooked "
          f"{block_median:.4f} (quartiles {block_quartiles[0]:.4f}–{block_quartiles[2]:.4f}), "
          f"structure-only control {control_median:.4f} "
          f"(quartiles {control_quartiles[0]:.4f}–{control_quartiles[2]:.4f})")
    memory_median = statistics.median(blocks["hooked_memory"])
    every_step_median = statistics.median(blocks["memory_every_step"])
    sampled_us = statistics.median(blocks["sampled_breakdown_us"])
    print(f"blocks: with the memory breakdown watched (a sample every 5 s) median ratio "
          f"{memory_median:.4f}; sampled on every step {every_step_median:.4f}: one sampled "
          f"breakdown costs {sampled_us:.0f} µs")
    python_median = statistics.median(blocks["hooked_python"]) if "hooked_python" in blocks else None
    if python_median is not None:
        print(f"blocks: the same hook on the pure-Python core (the C core's before), median ratio "
              f"{python_median:.4f}")
    block_monitors = 4 if python_median is not None else 3
    expected = args.pairs * (args.steps + 1) + block_monitors * ((args.blocks + 1) * args.block_steps + 1)
    print(f"records received by the reader: {received} (expected {expected})")
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
                "hook_core": IMPLEMENTATION,
                "blocks_python_median_ratio": python_median,
                "blocks": args.blocks,
                "block_steps": args.block_steps,
                "blocks_median_ratio": block_median,
                "blocks_ratio_quartiles": [block_quartiles[0], block_quartiles[2]],
                "blocks_control_median_ratio": control_median,
                "blocks_control_ratio_quartiles": [control_quartiles[0], control_quartiles[2]],
                "blocks_memory_median_ratio": memory_median,
                "blocks_memory_every_step_median_ratio": every_step_median,
                "sampled_breakdown_us": sampled_us,
                "records_received": received,
            }
        )
    )


if __name__ == "__main__":
    main()
