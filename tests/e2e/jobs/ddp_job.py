"""A DDP training job on CPU (gloo) for the distributed tests, launched by ``torch.distributed.run``.

Each rank reports its steps through ``StepMonitor`` with ``watch(ddp)`` and writes what it
measured itself, independently of gpumon, to ``OUT/rank<R>.json``: with ``--truth``, every
reported (synchronising) step is followed by the same step under ``ddp.no_sync()``, timed here
and not reported, then a barrier (untimed) that re-aligns the ranks, so ``1 - t(no_sync) /
t(sync)`` is the share of the step communication cost.

Knobs make the cases the tests need: a communication-heavy model (4 x Linear(2048, 2048),
batch 2: 64 MiB of gradients per step) or a compute-heavy one (a small MLP, batch 8192); one
rank doing extra forward work, waiting longer for its batches, or sharing its core with
two processes that only spin (on a small model, so that is what stands out); a user comm hook; no
watch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from time import perf_counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gpumon.client import StepMonitor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", choices=("comm", "compute", "small"), default="comm")
    parser.add_argument("--truth", action="store_true", help="time a no_sync twin of every step")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-forward-ms", type=float, default=0.0)
    parser.add_argument("--slow-input-ms", type=float, default=0.0)
    parser.add_argument("--hog-rank", type=int, default=-1,
                        help="pin each rank to one core, and two spinning processes beside this one")
    parser.add_argument("--comm-hook", choices=("none", "fp16"), default="none")
    parser.add_argument("--hook-before-watch", action="store_true")
    parser.add_argument("--no-watch", action="store_true")
    parser.add_argument("--bucket-view", action="store_true", help="gradient_as_bucket_view=True")
    parser.add_argument("--batch", type=int, default=0, help="the model's batch size instead of its own")
    args = parser.parse_args()

    # Pinned before gloo starts its threads, so that they are pinned too.
    hogs = _share_core(int(os.environ["RANK"]), args.hog_rank) if args.hog_rank >= 0 else []
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if args.model == "comm":
        model: nn.Module = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
        batch, width = 2, 2048
    elif args.model == "small":  # little of either: what a rank does on top stands out
        model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
        batch, width = 64, 128
    else:
        # A small MLP on a large batch: 3 MiB of gradients against 39 GFLOP a step, so even on
        # two shared cores the all-reduce is a small share of the step.
        model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 512))
        batch, width = 8192, 512
    batch = args.batch or batch
    ddp = DDP(model, gradient_as_bucket_view=args.bucket_view)
    mon = StepMonitor()
    hook = default_hooks.fp16_compress_hook if args.comm_hook == "fp16" else None
    if hook is not None and args.hook_before_watch:
        ddp.register_comm_hook(None, hook)
    if not args.no_watch:
        mon.watch(ddp)
    if hook is not None and not args.hook_before_watch:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    slow = rank == args.slow_rank

    def batches() -> Iterator[torch.Tensor]:
        generator = torch.Generator().manual_seed(rank)
        while True:
            if slow and args.slow_input_ms:
                time.sleep(args.slow_input_ms / 1e3)
            yield torch.randn(batch, width, generator=generator)

    def train(x: torch.Tensor, monitored: bool) -> None:
        with mon.phase("forward") if monitored else nullcontext():
            loss = ddp(x).square().mean()
            if slow and args.slow_forward_ms:
                time.sleep(args.slow_forward_ms / 1e3)
        with mon.phase("backward") if monitored else nullcontext():
            loss.backward()
        with mon.phase("optimizer") if monitored else nullcontext():
            opt.step()
            opt.zero_grad()

    def unsynced(x: torch.Tensor) -> float:
        t0, c0 = perf_counter(), time.thread_time()
        with ddp.no_sync():
            train(x, monitored=False)
        unsynced_cpu_s.append(time.thread_time() - c0)
        return perf_counter() - t0

    unsynced_cpu_s: list[float] = []  # the training thread's CPU time in each no_sync twin
    data = batches()
    for _ in range(args.warmup):  # DDP sizes its buckets after the first step; not reported
        train(next(data), monitored=False)
        if args.truth:
            unsynced(next(data))
            dist.barrier()
    synced_s, unsynced_s = [], []
    thread_cpu_s: list[float] = []  # CPU time of the training thread: its work, not its waits
    process_cpu_s: list[float] = []  # ... and of the whole process (gloo's threads too)
    preempted: list[int] = []  # times the training thread was switched out while runnable
    cpu_wait_s: list[float] = []  # ... and for how long: its run delay, from the kernel
    grads: list[torch.Tensor] = []
    for i, x in enumerate(mon.loader(data)):
        t0, c0, p0 = perf_counter(), time.thread_time(), time.process_time()
        switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
        delay = _run_delay_s()
        with mon.step(samples=batch):
            train(x, monitored=True)
        synced_s.append(perf_counter() - t0)
        thread_cpu_s.append(time.thread_time() - c0)
        process_cpu_s.append(time.process_time() - p0)
        preempted.append(resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw - switches)
        cpu_wait_s.append(_run_delay_s() - delay)
        if i == args.steps - 1:
            break
        if args.truth:
            unsynced_s.append(unsynced(x))
            # Each rank times its own twin, so they end apart: without this the faster
            # rank's next synced step would wait for its peer's twin, which no real job does.
            dist.barrier()
    # The gradients of one more synchronised step, kept for comparing runs.
    ddp(next(data)).square().mean().backward()
    grads = [p.grad.detach().clone() for p in ddp.parameters() if p.grad is not None]
    mon.close()
    for hog in hogs:
        hog.kill()
        hog.wait()
    summary = {
        "rank": rank, "world": world, "synced_s": synced_s, "unsynced_s": unsynced_s,
        "unsynced_cpu_s": unsynced_cpu_s[args.warmup:],
        "thread_cpu_s": thread_cpu_s, "process_cpu_s": process_cpu_s, "preempted": preempted,
        "cpu_wait_s": cpu_wait_s,
        "grad_bytes": sum(p.numel() * p.element_size() for p in ddp.parameters()),
        "grads_sha": _digest(grads), "stats": mon.stats.dropped,
        "comm_hook": ddp._get_ddp_logging_data().get("comm_hook", ""),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(summary))
    dist.destroy_process_group()


def _run_delay_s() -> float:
    """The calling thread's time spent runnable, waiting for a CPU (Linux's schedstat)."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def _share_core(rank: int, hog_rank: int) -> list[subprocess.Popen[bytes]]:
    """Pin this rank to a core of its own; the ``hog_rank`` rank gets two spinning processes
    on its core, so its threads have a third of it."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    if rank != hog_rank:
        return []
    # It spins while this rank lives (at most ten minutes), whatever becomes of the rank.
    spin = (f"import os, time\nend = time.time() + 600\n"
            f"while os.getppid() == {os.getpid()} and time.time() < end: pass")
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    for spinner in spinners:
        os.sched_setaffinity(spinner.pid, {core})
    return spinners


def _digest(tensors: list[torch.Tensor]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    os.environ.setdefault("GPUMON_RUN", "ddp-job")
    main()
