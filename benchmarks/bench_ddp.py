"""What ``StepMonitor.watch(ddp)`` costs a DDP job: throughput with and without it, and the
cost per collective.

    python benchmarks/bench_ddp.py [--ranks 2] [--rounds 12] [--block-steps 3]
                                   [--small-rounds 12] [--small-block-steps 10]

Runs itself under ``torch.distributed.run`` (gloo, CPU, one intra-op thread per rank). Each
rank holds two identical DDP models, each with its own monitor reporting every step (phases
and all) to a real Unix datagram socket drained by a reader process; only one of the two
models is watched. Blocks of steps alternate between them, the order flipping every round,
so both see the same machine; the figure is the median over rounds of the throughput ratio
watched ÷ plain.

- ``job``: the communication-heavy job (4 × Linear(2048, 2048), batch 2: 64 MiB all-reduced
  in 3 buckets a step);
- ``per collective``: 48 small layers in 48 buckets of 16 KiB a step, where the all-reduces
  are most of the step: (watched − plain step time) ÷ buckets, in µs, is what timing one
  bucket costs (the wrapper hook, the wrapped ``all_reduce``, the completion callback on the
  gloo thread, the step's bookkeeping spread over its buckets).

Any comm hook makes DDP copy each gradient into its bucket as it is and leaves the averaging
to the hook: one more pass over the gradients a step than DDP's own path, which scales them
in that copy. On CPU, where the communication-heavy job is bound by memory bandwidth, that
pass is most of what watching costs; ``--bucket-view`` runs both models with
``gradient_as_bucket_view=True``, where DDP makes no copy and the pass is the same either way.

``--stock-hook`` registers torch's own ``allreduce_hook`` on the second model instead of
watching it: what a Python comm hook costs DDP by itself, for comparison.

``--control`` watches neither model: the ratio it reads is what this machine reads for no
difference. Two DDP models in one process do not run alike: on a quiet 2-core machine the
control read 1.13 (1.035 with glibc's malloc kept from returning the gradients' memory to the
kernel every step), so in-process ratios carry that bias. ``--processes K`` avoids it: K pairs
of separate jobs, one model each, watched and not, the order flipping every pair; the figure
is the median over pairs of the throughput ratio (``--control`` applies to it as well), with
the CPU watching adds a step (training thread; whole process, gloo's threads too): far less
noisy than the wall clock when two ranks share two cores.

``--ranks 1`` runs the same in a world of one: no peer to wait for, so the per-collective
figure is the CPU the timing adds, without the noise of two ranks scheduling each other's
all-reduce.

Prints a line per rank and a JSON line (rank 0's figures, which the other ranks match within
noise: a DDP step ends together on every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block-steps", type=int, default=3)
    parser.add_argument("--small-rounds", type=int, default=12)
    parser.add_argument("--small-block-steps", type=int, default=10)
    parser.add_argument("--bucket-view", action="store_true",
                        help="DDP(gradient_as_bucket_view=True): no gradient copies into buckets")
    parser.add_argument("--stock-hook", action="store_true",
                        help="instead of watching, register torch's own Python allreduce_hook: what "
                             "any Python comm hook costs")
    parser.add_argument("--control", action="store_true",
                        help="watch neither model: the ratio this machine reads for no difference")
    parser.add_argument("--processes", type=int, default=0, metavar="K",
                        help="K pairs of separate one-model jobs instead of two models in one")
    parser.add_argument("--steps", type=int, default=40, help="steps of each job with --processes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--single", choices=("plain", "watched"), help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.worker:
        single_worker(args) if args.single else worker(args)
        return
    if args.processes:
        in_processes(args)
        return
    with _launched(args.ranks, ["--worker", *sys.argv[1:]]) as (ranks, received):
        pass
    for result in sorted(ranks, key=lambda r: r["rank"]):
        print(f"rank {result['rank']}: job throughput watched/plain {result['job_ratio']:.4f} "
              f"(step {result['job_step_ms']:.1f} ms), per collective {result['per_collective_us']:.1f} µs "
              f"({result['buckets']} buckets a step of {result['small_step_ms']:.2f} ms)")
    print(f"records received by the reader: {received}")
    rank0 = next(r for r in ranks if r["rank"] == 0)
    print(json.dumps({"bench": "ddp", "control": args.control, "stock_hook": args.stock_hook,
                      "bucket_view": args.bucket_view,
                      "ranks": args.ranks,
                      "job_throughput_ratio": rank0["job_ratio"],
                      "per_collective_us": rank0["per_collective_us"], "records_received": received}))


@contextmanager
def _launched(nproc: int, worker_args: list[str]) -> Iterator[tuple[list[dict[str, Any]], int]]:
    """Run this file's worker under ``torch.distributed.run``, reporting to a drained socket;
    yields each rank's result and the records the reader received."""
    sys.path.insert(0, str(HERE))
    from bench_hook import drained_socket

    from gpumon.testing import free_port

    with drained_socket() as (socket_path, finish), tempfile.TemporaryDirectory() as results:
        env = {**os.environ, "GPUMON_SOCKET": socket_path, "GPUMON_RUN": "bench-ddp",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent), "BENCH_DDP_RESULTS": results}
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--master-port", str(free_port()), __file__, *worker_args],
            env=env, capture_output=True, text=True)
        received = finish()
        if done.returncode != 0:
            sys.exit(f"the job failed:\n{done.stdout}\n{done.stderr[-6000:]}")
        yield [json.loads(path.read_text()) for path in Path(results).glob("rank*.json")], received


def in_processes(args: argparse.Namespace) -> None:
    """``--processes``: pairs of one-model jobs, watched and plain, alternating."""
    ratios, steps_ms, thread_cpu, process_cpu = [], [], [], []
    passed = ["--steps", str(args.steps)] + [flag for flag, on in (
        ("--control", args.control), ("--stock-hook", args.stock_hook),
        ("--bucket-view", args.bucket_view)) if on]
    for pair in range(args.processes):
        order = ["plain", "watched"] if pair % 2 == 0 else ["watched", "plain"]
        step_s, cpu = {}, {}
        for single in order:
            with _launched(args.ranks, ["--worker", "--single", single, *passed]) as (ranks, _):
                step_s[single] = statistics.median(r["step_s"] for r in ranks)
                cpu[single] = (statistics.median(r["thread_cpu_s"] for r in ranks),
                               statistics.median(r["process_cpu_s"] for r in ranks))
        ratios.append(step_s["plain"] / step_s["watched"])
        steps_ms.append(step_s["plain"] * 1e3)
        thread_cpu.append((cpu["watched"][0] - cpu["plain"][0]) * 1e3)
        process_cpu.append((cpu["watched"][1] - cpu["plain"][1]) * 1e3)
        print(f"pair {pair}: plain {step_s['plain'] * 1e3:.1f} ms, watched "
              f"{step_s['watched'] * 1e3:.1f} ms a step: throughput ratio {ratios[-1]:.4f}; "
              f"CPU added a step: training thread {thread_cpu[-1]:+.2f} ms, "
              f"process {process_cpu[-1]:+.2f} ms")
    print(json.dumps({"bench": "ddp", "mode": "processes", "control": args.control,
                      "stock_hook": args.stock_hook, "bucket_view": args.bucket_view,
                      "ranks": args.ranks, "pairs": args.processes, "steps": args.steps,
                      "job_throughput_ratio": statistics.median(ratios),
                      "plain_step_ms": statistics.median(steps_ms),
                      "thread_cpu_added_ms": statistics.median(thread_cpu),
                      "process_cpu_added_ms": statistics.median(process_cpu)}))


def single_worker(args: argparse.Namespace) -> None:
    """One model, watched or not: the median step time of ``--steps`` steps after warm-up."""
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    watch: bool | str = False
    if args.single == "watched":
        watch = "stock" if args.stock_hook else not args.control
    arm = Arm(lambda: nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]), watched=watch,
              gradient_as_bucket_view=args.bucket_view)
    walls, threads, processes = [], [], []
    for _ in range(args.steps):
        thread0, process0 = time.thread_time(), time.process_time()
        walls.append(arm.run(1))
        threads.append(time.thread_time() - thread0)
        processes.append(time.process_time() - process0)
    Path(os.environ["BENCH_DDP_RESULTS"], f"rank{dist.get_rank()}.json").write_text(json.dumps({
        "rank": dist.get_rank(), "step_s": statistics.median(walls),
        "thread_cpu_s": statistics.median(threads), "process_cpu_s": statistics.median(processes)}))
    dist.destroy_process_group()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    torch.set_num_threads(1)

    def comm_heavy() -> nn.Module:
        return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])

    def small() -> nn.Module:
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(48)])

    watch: bool | str = "stock" if args.stock_hook else not args.control
    view = args.bucket_view
    plain = Arm(comm_heavy, watched=False, gradient_as_bucket_view=view)
    watched = Arm(comm_heavy, watched=watch, gradient_as_bucket_view=view)
    job_s = _alternate(plain, watched, args.rounds, args.block_steps)
    job_ratios = [p / w for p, w in job_s]  # throughput watched ÷ plain
    plain = Arm(small, watched=False, bucket_cap_mb=0.016, gradient_as_bucket_view=view)
    watched = Arm(small, watched=watch, bucket_cap_mb=0.016, gradient_as_bucket_view=view)
    small_s = _alternate(plain, watched, args.small_rounds, args.small_block_steps)
    buckets = watched.buckets()
    steps = args.small_block_steps
    result = json.dumps({
        "rank": dist.get_rank(), "job_ratio": statistics.median(job_ratios),
        "job_step_ms": statistics.median(p for p, _ in job_s) / args.block_steps * 1e3,
        "per_collective_us": statistics.median((w - p) / steps for p, w in small_s) / buckets * 1e6,
        "buckets": buckets, "small_step_ms": statistics.median(p for p, _ in small_s) / steps * 1e3,
    })
    Path(os.environ["BENCH_DDP_RESULTS"], f"rank{dist.get_rank()}.json").write_text(result)
    dist.destroy_process_group()


class Arm:
    """One DDP model with its own monitor, watched or not, and its optimizer and batch."""

    def __init__(self, make: Callable[[], Any], watched: bool | str, **ddp_kwargs: Any) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from gpumon.client import StepMonitor

        torch.manual_seed(0)
        self.ddp = DDP(make(), **ddp_kwargs)
        self.mon = StepMonitor()
        if watched == "stock":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif watched:
            self.mon.watch(self.ddp)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-6)
        self.x = torch.randn(2, self.ddp.module[0].in_features)
        self.run(3)  # DDP sizes its buckets after the first step

    def run(self, n: int) -> float:
        """Seconds ``n`` monitored steps take, with the sender's work for them."""
        mon, ddp, opt = self.mon, self.ddp, self.opt
        t0 = perf_counter()
        for _ in range(n):
            with mon.step(samples=2):
                with mon.phase("forward"):
                    loss = ddp(self.x).square().mean()
                with mon.phase("backward"):
                    loss.backward()
                with mon.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
        mon.flush()
        return perf_counter() - t0

    def buckets(self) -> int:
        """Gradient buckets DDP all-reduces each step."""
        return len(self.ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))


def _alternate(plain: Arm, watched: Arm, rounds: int, steps: int) -> list[tuple[float, float]]:
    """(plain seconds, watched seconds) of ``steps``-step blocks, the order flipping each round."""
    out = []
    for i in range(rounds):
        arms = [(False, plain), (True, watched)]
        times = {}
        for is_watched, arm in arms if i % 2 == 0 else arms[::-1]:
            times[is_watched] = arm.run(steps)
        out.append((times[False], times[True]))
    return out


if __name__ == "__main__":
    main()
