"""What ``gpumon run`` costs a job that knows nothing of gpumon: throughput with and without it.

    python benchmarks/bench_run.py [--blocks 41] [--block-steps 40] [--ddp-pairs 5] [--ddp-steps 12]

- ``cpu``: ``examples/train_plain.py``'s loop (the MLP on in-memory data, one intra-op thread)
  in this one process, in blocks of ``--block-steps`` steps alternating with ``gpumon run``'s
  hooks in torch (``gpumon.client.autowatch.hooks.install()``, what its ``sitecustomize`` does)
  and taken out again, the order flipping every round, reporting to a real Unix datagram socket
  drained by a reader process. A watched block ends with a synchronous flush of its records,
  timed with it. The figures are medians over rounds: the throughput ratio watched ÷ bare, and
  the training thread's CPU time, bare ÷ watched and added per step (far less noisy than the
  wall clock on a shared machine). ``tiny`` runs the same loop on a model of 8 units and a
  batch of 8, where the loop's own Python is most of the step and what the hooks add shows.
- ``ddp``: the communication-heavy 2-rank DDP job (4 × Linear(2048, 2048), batch 2, gloo) as a
  whole, under ``torch.distributed.run``, started plain and under ``gpumon run``, in
  ``--ddp-pairs`` pairs, the order flipping every pair (a DDP model once watched keeps its comm
  hook, so the two cannot alternate in one process). Each rank times its steps after a warm-up;
  the figure is the median over pairs of the ratio of the ranks' median step times.

Prints a line per round or pair and a JSON line.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=41)
    parser.add_argument("--block-steps", type=int, default=40)
    parser.add_argument("--ddp-pairs", type=int, default=5)
    parser.add_argument("--ddp-steps", type=int, default=12)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        ddp_worker(args.ddp_steps)
        return
    cpu = cpu_blocks(args.blocks, args.block_steps)
    # A model so small that the step is mostly the loop's own Python: what the hooks add shows.
    tiny = cpu_blocks(args.blocks, args.block_steps * 10, ("--hidden", "8", "--batch-size", "8"))
    ddp = ddp_pairs(args.ddp_pairs, args.ddp_steps) if args.ddp_pairs else None
    print(json.dumps({"bench": "run", "cpu": cpu, "tiny": tiny, "ddp_throughput_ratio": ddp,
                      "blocks": args.blocks, "block_steps": args.block_steps,
                      "ddp_pairs": args.ddp_pairs, "ddp_steps": args.ddp_steps}))


def cpu_blocks(blocks: int, block_steps: int, extra: tuple[str, ...] = ()) -> dict[str, float]:
    from bench_hook import drained_socket
    from train_plain import make_job, parse_args, train

    from gpumon.client import StepMonitor
    from gpumon.client.autowatch import hooks

    with drained_socket() as (socket_path, finish):
        hooks.make_monitor = lambda: StepMonitor("bench-run", socket_path=socket_path)
        job = make_job(parse_args(["--threads", "1", *extra]))
        cpu_s: dict[bool, float] = {}

        def seconds(watched: bool) -> float:
            if watched:
                hooks.install()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            train(job, block_steps)
            if watched:
                finder = hooks._state.finder
                if finder is not None:
                    finder.monitor.flush()
            elapsed = time.perf_counter() - t0
            cpu_s[watched] = time.thread_time() - c0
            if watched:
                hooks.take_out()
            return elapsed

        seconds(False), seconds(True)  # warm both up (the watch starts on the first watched step)
        ratios, cpu_ratios, added_us = [], [], []
        for i in range(blocks):
            order = (False, True) if i % 2 == 0 else (True, False)
            times = {watched: seconds(watched) for watched in order}
            ratios.append(times[False] / times[True])
            cpu_ratios.append(cpu_s[False] / cpu_s[True])
            added_us.append((cpu_s[True] - cpu_s[False]) / block_steps * 1e6)
        finder = hooks._state.finder
        steps = 0 if finder is None else finder.monitor.stats.steps
        hooks.uninstall()
        received = finish()
    low, _, high = statistics.quantiles(ratios, n=4)
    result = {"throughput_ratio": statistics.median(ratios),
              "thread_cpu_ratio": statistics.median(cpu_ratios),
              "thread_cpu_added_us_per_step": statistics.median(added_us),
              "bare_step_ms": statistics.median(cpu_s.values()) / block_steps * 1e3}
    print(f"cpu {' '.join(extra) or 'example'}: {blocks} rounds of {block_steps}-step blocks, {steps} steps "
          f"watched, {received} records received; throughput watched / bare: median "
          f"{result['throughput_ratio']:.4f} (quartiles {low:.4f} .. {high:.4f}); training thread's CPU "
          f"bare / watched {result['thread_cpu_ratio']:.4f}, "
          f"{result['thread_cpu_added_us_per_step']:+.1f} µs a step")
    return result


def ddp_pairs(pairs: int, steps: int) -> float:
    from bench_hook import drained_socket

    from gpumon.testing import free_port

    ratios = []
    with drained_socket() as (socket_path, finish):
        for pair in range(pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            step_s = {}
            for watched in order:
                with tempfile.TemporaryDirectory() as results:
                    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                           "BENCH_RUN_RESULTS": results}
                    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-port", str(free_port()), __file__, "--worker",
                               "--ddp-steps", str(steps)]
                    if watched:
                        command = [sys.executable, "-m", "gpumon.cli", "run", "--run", "bench-run-ddp",
                                   "--socket", socket_path, "--", *command]
                    done = subprocess.run(command, env=env, capture_output=True, text=True)
                    if done.returncode != 0:
                        sys.exit(f"the job failed:\n{done.stdout}\n{done.stderr[-6000:]}")
                    ranks = [json.loads(p.read_text()) for p in Path(results).glob("rank*.json")]
                    step_s[watched] = statistics.median(r["step_s"] for r in ranks)
            ratios.append(step_s[False] / step_s[True])
            print(f"ddp pair {pair}: plain {step_s[False] * 1e3:.1f} ms, under gpumon run "
                  f"{step_s[True] * 1e3:.1f} ms a step: throughput ratio {ratios[-1]:.4f}")
        received = finish()
    print(f"ddp: {received} records received; median throughput ratio {statistics.median(ratios):.4f}")
    return statistics.median(ratios)


def ddp_worker(steps: int) -> None:
    """One rank of the plain DDP job: its median step time after three warm-up steps."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(2, 2048)
    times = []
    for i in range(3 + steps):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    rank = dist.get_rank()
    Path(os.environ["BENCH_RUN_RESULTS"], f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "step_s": statistics.median(times)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
