"""A DDP training job on CPU (gloo) for the distributed tests, launched by ``torch.distributed.run``.

Each rank reports its steps through ``StepMonitor`` with ``watch(ddp)`` and writes what it
measured itself, independently of gpumon, to ``OUT/rank<R>.json``: for every reported step,
its own clocks over the step and over its backward (where DDP's collectives run): wall time,
the training thread's CPU time, its run delay (runnable, waiting for a CPU), the time the
hypervisor stole from its core, and how long it slept in device-like work. Off a CPU and not
runnable is waiting; less the sleeps, what is left is what it waited for its peers.

Knobs make the cases the tests need: a communication-heavy model (4 x Linear(2048, 2048),
batch 2: 64 MiB of gradients per step), a compute-heavy one (a small MLP, batch 8192), a
small one, or one whose work is device-like (0.5 MiB of gradients); device-like work (a
sleep where a GPU would leave the host thread waiting for its kernels) in forward, and on
rank 1 alone at the top of backward, so that its peer's first buckets are in flight while
that peer still works through backward (``--overlap-ms`` of CPU work there); a comm hook
completing each bucket's future a known delay late (``--delay-ms``: in each four steps, one
on time, one late, two under ``no_sync``, all reported); ranks pinned to a core each; one
rank doing extra forward work, waiting longer for its batches, or sharing its core with two
processes that only spin (on a small model, so that is what stands out); a user comm hook;
no watch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
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
    parser.add_argument("--model", choices=("comm", "compute", "small", "device"), default="comm")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-forward-ms", type=float, default=0.0)
    parser.add_argument("--slow-input-ms", type=float, default=0.0)
    parser.add_argument("--hog-rank", type=int, default=-1,
                        help="pin each rank to a core, and on this one a spinner that outweighs it")
    parser.add_argument("--comm-hook", choices=("none", "fp16"), default="none")
    parser.add_argument("--hook-before-watch", action="store_true")
    parser.add_argument("--no-watch", action="store_true")
    parser.add_argument("--bucket-view", action="store_true", help="gradient_as_bucket_view=True")
    parser.add_argument("--batch", type=int, default=0, help="the model's batch size instead of its own")
    parser.add_argument("--pin", action="store_true", help="pin each rank to a core of its own")
    parser.add_argument("--device-ms", type=float, default=0.0, help="device-like work in forward")
    parser.add_argument("--skew-ms", type=float, default=0.0,
                        help="device-like work at the top of rank 1's backward")
    parser.add_argument("--overlap-ms", type=float, default=0.0,
                        help="CPU work in backward after the last layers' buckets are launched")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="complete each bucket's future this late on every other synced step")
    args = parser.parse_args()

    # Pinned before gloo starts its threads, so that they are pinned too.
    rank_env = int(os.environ["RANK"])
    hogs = _share_core(rank_env, args.hog_rank) if args.hog_rank >= 0 else []
    if args.pin and args.hog_rank < 0:
        _share_core(rank_env, -1)
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
    elif args.model == "device":  # 0.5 MiB of gradients; its work is the device-like sleep
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
        batch, width = 64, 256
    else:
        # A small MLP on a large batch: 3 MiB of gradients against 39 GFLOP a step, so even on
        # two shared cores the all-reduce is a small share of the step.
        model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 512))
        batch, width = 8192, 512
    batch = args.batch or batch
    slept: list[float] = [0.0]  # device-like work slept through in the current step

    def device_work(ms: float) -> None:
        if ms > 0:
            t0 = perf_counter()
            time.sleep(ms / 1e3)
            slept[0] += perf_counter() - t0

    layers = list(model.children())
    if args.overlap_ms:  # CPU work between the first layer and the rest: in backward, it runs
        layers.insert(1, _Work(lambda: _spin(args.overlap_ms)))  # once the rest are launched
    if args.skew_ms and rank == 1:  # at the top of backward, before any bucket is ready
        layers.append(_Work(lambda: device_work(args.skew_ms)))
    model = nn.Sequential(*layers)
    ddp = DDP(model, gradient_as_bucket_view=args.bucket_view)
    mon = StepMonitor()
    hook = default_hooks.fp16_compress_hook if args.comm_hook == "fp16" else None
    if hook is not None and args.hook_before_watch:
        ddp.register_comm_hook(None, hook)
    if not args.no_watch:
        mon.watch(ddp)
    if hook is not None and not args.hook_before_watch:
        ddp.register_comm_hook(None, hook)
    delaying = [False]
    lateness_s: list[float] = []  # how late each held future was completed, as measured
    if args.delay_ms:
        ddp.register_comm_hook(delaying, _late_by(args.delay_ms / 1e3, lateness_s))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    slow = rank == args.slow_rank

    def batches() -> Iterator[torch.Tensor]:
        generator = torch.Generator().manual_seed(rank)
        while True:
            t0 = perf_counter()
            if slow and args.slow_input_ms:
                time.sleep(args.slow_input_ms / 1e3)
            x = torch.randn(batch, width, generator=generator)
            fetched_s.append(perf_counter() - t0)
            yield x

    def train(x: torch.Tensor, monitored: bool) -> None:
        with mon.phase("forward") if monitored else nullcontext():
            loss = ddp(x).square().mean()
            device_work(args.device_ms)
            if slow and args.slow_forward_ms:
                device_work(args.slow_forward_ms)
        with mon.phase("backward") if monitored else nullcontext():
            b0 = _clocks(core, slept[0])
            loss.backward()
            if monitored:  # the only phase a collective runs in
                backward_s.append([b - a for a, b in zip(b0, _clocks(core, slept[0]), strict=True)])
        with mon.phase("optimizer") if monitored else nullcontext():
            opt.step()
            opt.zero_grad()

    core = f"cpu{next(iter(os.sched_getaffinity(0)))}" if args.pin or args.hog_rank >= 0 else "cpu"
    fetched_s: list[float] = []  # how long each batch took to make, inside the generator
    data_s: list[float] = []  # ... for each reported step, the batch it trained on
    late_s: list[float] = []  # each reported step's latest held future: how late it completed
    backward_s: list[list[float]] = []  # each reported step's backward: as _clocks()
    data = batches()
    for _ in range(args.warmup):  # DDP sizes its buckets after the first step; not reported
        train(next(data), monitored=False)
    wall_s: list[float] = []
    thread_cpu_s: list[float] = []  # CPU time of the training thread: its work, not its waits
    process_cpu_s: list[float] = []  # ... and of the whole process (gloo's threads too)
    preempted: list[int] = []  # times the training thread was switched out while runnable
    cpu_wait_s: list[float] = []  # ... and for how long: its run delay, from the kernel
    steal_s: list[float] = []  # time the hypervisor stole from its core (all cores, unpinned)
    slept_s: list[float] = []  # device-like work: slept through, as a GPU would leave it waiting
    kinds: list[str] = []  # "sync", "sync-late" (its buckets completed late), "no_sync"
    grads: list[torch.Tensor] = []
    for i, x in enumerate(mon.loader(data)):
        kind = "sync"
        if args.delay_ms:  # sync, sync-late, no_sync, no_sync (late, had it all-reduced)
            kind = ("sync", "sync-late", "no_sync", "no_sync")[i % 4]
            delaying[0] = kind == "sync-late" or i % 4 == 3
        slept[0] = 0.0
        lateness_s.clear()
        steal = _steal_s(core)
        t0, c0, p0 = perf_counter(), time.thread_time(), time.process_time()
        switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
        delay = _run_delay_s()
        with mon.step(samples=batch), ddp.no_sync() if kind == "no_sync" else nullcontext():
            train(x, monitored=True)
        wall_s.append(perf_counter() - t0)
        thread_cpu_s.append(time.thread_time() - c0)
        process_cpu_s.append(time.process_time() - p0)
        preempted.append(resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw - switches)
        cpu_wait_s.append(_run_delay_s() - delay)
        steal_s.append(_steal_s(core) - steal)
        slept_s.append(slept[0])
        kinds.append(kind)
        data_s.append(fetched_s[-1])
        late_s.append(max(lateness_s, default=0.0))
        if i == args.steps - 1:
            break
        if args.delay_ms or args.pin:
            dist.barrier()  # the next step starts with the ranks aligned, as the job is built
    # The gradients of one more synchronised step, kept for comparing runs.
    ddp(next(data)).square().mean().backward()
    grads = [p.grad.detach().clone() for p in ddp.parameters() if p.grad is not None]
    mon.close()
    for hog in hogs:
        hog.kill()
        hog.wait()
    summary = {
        "rank": rank, "world": world, "wall_s": wall_s,
        "thread_cpu_s": thread_cpu_s, "process_cpu_s": process_cpu_s, "preempted": preempted,
        "cpu_wait_s": cpu_wait_s, "steal_s": steal_s, "slept_s": slept_s, "kinds": kinds,
        "backward_s": backward_s, "data_s": data_s, "late_s": late_s,
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


def _clocks(core: str, slept_s: float) -> tuple[float, float, float, float, float]:
    """Now: wall, the thread's CPU time, its run delay, the steal from ``core``, and slept."""
    return perf_counter(), time.thread_time(), _run_delay_s(), _steal_s(core), slept_s


def _steal_s(cpu: str) -> float:
    """Time the hypervisor has stolen from ``cpu`` (a core, or all of them), from /proc/stat."""
    with open("/proc/stat") as f:
        for line in f:
            fields = line.split()
            if fields[0] == cpu:
                return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    return 0.0


def _spin(ms: float) -> None:
    """CPU work for ``ms`` of this thread's CPU time."""
    end = time.thread_time() + ms / 1e3
    a = torch.ones(64, 64)
    while time.thread_time() < end:
        a = (a @ a).clamp_(max=1.0)


class _Work(nn.Module):
    """The identity in forward; ``work()`` in its backward."""

    def __init__(self, work: object) -> None:
        super().__init__()
        self.work = work

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Backward.apply(x, self.work)  # type: ignore[no-any-return]


class _Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, work: object) -> torch.Tensor:
        ctx.work = work  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.work()  # type: ignore[attr-defined]
        return grad, None


def _late_by(delay_s: float, lateness_s: list[float]) -> object:
    """A comm hook all-reducing as DDP does, whose future completes ``delay_s`` after the
    all-reduce did while its state (a one-item list) holds True; how late each one actually
    completed (the timer's thread wakes when it can) is appended to ``lateness_s``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads no annotation but its own
        future = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
        if not state[0]:
            return future
        late: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def complete(done: torch.futures.Future[torch.Tensor]) -> None:
            t_done = perf_counter()

            def release() -> None:
                lateness_s.append(perf_counter() - t_done)
                late.set_result(done.value())

            threading.Timer(delay_s, release).start()

        future.add_done_callback(complete)
        return late

    return hook


HOG_NICE = 5
"""The shared rank's nice value: a weight of 335, a third of the spinner's 1024."""


def _share_core(rank: int, hog_rank: int) -> list[subprocess.Popen[bytes]]:
    """Pin this rank to a core of its own; the ``hog_rank`` rank shares its core with a
    spinning process that outweighs it.

    The handicap is a weight, not a count of spinners: this rank runs at nice +5 (a weight of
    335 against the spinner's 1024), so it gets about a quarter of its core whenever the
    spinner is runnable, and its core's load stays about one task's. The scheduler then has
    no reason to move the host's other work onto the peer's core: with two spinners at equal
    weight it did, and under a busy host the peer's core ended as shared as this one.
    """
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    if rank != hog_rank:
        return []
    # It spins while this rank lives (at most ten minutes), whatever becomes of the rank; it
    # starts before this rank lowers its own weight, so that it keeps the default.
    spin = (f"import os, time\nend = time.time() + 600\n"
            f"while os.getppid() == {os.getpid()} and time.time() < end: pass")
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    os.sched_setaffinity(spinner.pid, {core})
    for thread in os.listdir("/proc/self/task"):  # nice is a thread's; later threads inherit it
        os.setpriority(os.PRIO_PROCESS, int(thread), HOG_NICE)
    return [spinner]


def _digest(tensors: list[torch.Tensor]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    os.environ.setdefault("GPUMON_RUN", "ddp-job")
    main()
