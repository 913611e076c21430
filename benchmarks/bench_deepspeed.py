"""What ``StepMonitor.watch(engine)`` costs a DeepSpeed job: throughput with and without it.

    python benchmarks/bench_deepspeed.py [--ranks 2] [--stage 2] [--rounds 8] [--block-steps 3]
                                         [--control]

Runs itself under ``torch.distributed.run`` (``DS_ACCELERATOR=cpu``, gloo, one intra-op
thread per rank). Each rank holds two identical engines (4 × Linear(2048, 2048), batch 2,
fused AdamW, the ZeRO stage asked for): one trained as a plain DeepSpeed loop with no gpumon at
all, the other watched (``mon.watch(engine)``, nothing else: its steps, phases, communication
and sampled memory breakdown), reporting to a real Unix datagram socket drained by a reader
process. Blocks of steps alternate between them, the order flipping every round, so both see
the same machine; the figure is the median over rounds of the throughput ratio watched ÷
plain. ``--control`` watches neither: the ratio it reads is what this machine reads for no
difference (two engines in one process do not run alike).

Prints a line per rank and a JSON line (rank 0's figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter
from typing import Any

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block-steps", type=int, default=3)
    parser.add_argument("--control", action="store_true", help="watch neither engine")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(HERE))
    from bench_hook import drained_socket

    from gpumon.testing import free_port

    worker_args = ["--worker", "--stage", str(args.stage), "--rounds", str(args.rounds),
                   "--block-steps", str(args.block_steps), *(["--control"] if args.control else [])]
    with drained_socket() as (socket_path, finish), tempfile.TemporaryDirectory() as results:
        env = {**os.environ, "GPUMON_SOCKET": socket_path, "GPUMON_RUN": "bench-deepspeed",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent), "DS_ACCELERATOR": "cpu",
               "BENCH_DS_RESULTS": results}
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
             "--master-port", str(free_port()), __file__, *worker_args],
            env=env, capture_output=True, text=True)
        received = finish()
        if done.returncode != 0:
            sys.exit(f"the job failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        ranks = sorted((json.loads(p.read_text()) for p in Path(results).glob("rank*.json")),
                       key=lambda r: r["rank"])
    for r in ranks:
        rounds = ", ".join(f"{x:.3f}" for x in r["ratios"])
        print(f"rank {r['rank']}: throughput watched/plain {r['ratio']:.3f} (rounds {rounds}); "
              f"plain step {r['plain_step_ms']:.0f} ms")
    print(f"records received by the reader: {received}")
    rank0 = ranks[0]
    print(json.dumps({"bench": "deepspeed", "stage": args.stage, "control": args.control,
                      "ratio": rank0["ratio"], "ratios": rank0["ratios"],
                      "plain_step_ms": rank0["plain_step_ms"], "records_received": received}))


class Arm:
    """One engine, watched by its own monitor or not monitored at all."""

    def __init__(self, stage: int, watched: bool) -> None:
        import deepspeed
        import torch
        from torch import nn

        from gpumon.client import StepMonitor

        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                  "zero_allow_untested_optimizer": True}
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.mon: Any = None
        if watched:
            self.mon = StepMonitor()
            self.mon.watch(self.engine)
        self.x = torch.randn(2, 2048)
        self.run(2)

    def run(self, n: int) -> float:
        """Seconds ``n`` optimizer steps take (with the sender's work for them, when watched)."""
        engine = self.engine
        t0 = perf_counter()
        for _ in range(n):
            loss = engine(self.x).square().mean()
            engine.backward(loss)
            engine.step()
        if self.mon is not None:
            self.mon.flush()
        return perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (a C++ op) at
    # init_distributed, for inference_all_reduce alone: off, as the timed loop never calls it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    plain, watched = Arm(args.stage, False), Arm(args.stage, not args.control)
    ratios, plain_s = [], []
    for i in range(args.rounds):
        arms = [(False, plain), (True, watched)]
        times = {}
        for is_watched, arm in arms if i % 2 == 0 else arms[::-1]:
            dist.barrier()
            times[is_watched] = arm.run(args.block_steps)
        ratios.append(times[False] / times[True])
        plain_s.append(times[False] / args.block_steps)
    rank = dist.get_rank()
    Path(os.environ["BENCH_DS_RESULTS"], f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "ratio": statistics.median(ratios), "ratios": ratios,
        "plain_step_ms": 1e3 * statistics.median(plain_s)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
