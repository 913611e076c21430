"""A pipeline-parallel training job on CPU (gloo) with ``torch.distributed.pipelining``, for the
model-parallel tests; launched by ``torch.distributed.run``, unchanged (no gpumon import), so
that it runs under ``gpumon run`` as a user's job would.

Each stage is a small linear layer followed by device-like work: a sleep of ``--work-ms`` (a
comma list, one per stage) in each micro-batch's forward and twice that in its backward, where
a GPU would leave the host thread waiting for its kernels. Each rank writes what it measured
itself, independently of gpumon, to ``OUT/rank<R>.json``: per step, the step's wall time
(``schedule.step`` and the optimizer), its own device-like work (the sleeps its stages did),
its training thread's CPU time (its host work) and its run delay (runnable, waiting for a
CPU: Linux's schedstat), and what is left of the step once its device-like and host work are
taken out (``blocked``): its waits for its neighbours (its bubble) and its sends', a waiting
thread's wake-up included. ``bubble`` is the step less its own device-like work alone.

With ``--dp 2`` (on twice the ranks) each stage is also sharded over two data-parallel replicas
with FSDP2 (``fully_shard``) on a ``("pp", "dp")`` mesh, as a pipeline with FSDP inside each
stage is: each replica gets its own batch.

    pipeline_job.py --out OUT --schedule gpipe|1f1b|interleaved --work-ms 4,10 [--steps N]
                    [--dp 2]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from time import perf_counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

WIDTH = 64
BATCH = 32
_slept = threading.local()


class DeviceWork(torch.autograd.Function):
    """Sleeps ``seconds`` in forward and twice that in backward, counting what it slept."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        _sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        _sleep(2 * ctx.seconds)
        return grad, None


def _sleep(seconds: float) -> None:
    start = perf_counter()
    time.sleep(seconds)
    _slept.seconds = getattr(_slept, "seconds", 0.0) + perf_counter() - start


def _run_delay_s() -> float:
    """The calling thread's time spent runnable, waiting for a CPU (Linux's schedstat)."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


class Stage(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.layer = nn.Linear(WIDTH, WIDTH)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DeviceWork.apply(torch.tanh(self.layer(x)), self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b")
    parser.add_argument("--work-ms", default="4,10",
                        help="device-like forward work per micro-batch, one per stage")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--dp", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size() // args.dp  # the pipeline's ranks
    group, replica = None, 0
    if args.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world, args.dp), mesh_dim_names=("pp", "dp"))
        group = mesh.get_group("pp")
        replica = mesh.get_local_rank("dp")
        rank = mesh.get_local_rank("pp")  # the rank in the pipeline
    work = [float(ms) / 1000 for ms in args.work_ms.split(",")]
    per_rank = 2 if args.schedule == "interleaved" else 1
    stages_total = world * per_rank
    assert len(work) == stages_total, f"--work-ms needs {stages_total} values"
    torch.manual_seed(0)
    indices = [rank + k * world for k in range(per_rank)]  # interleaved: rank, rank + world
    global_rank = dist.get_rank()
    stages, params = [], []
    for index in indices:
        module = Stage(work[index])
        if args.dp > 1:
            fully_shard(module, mesh=mesh["dp"])
        params += list(module.parameters())
        stages.append(PipelineStage(module, index, stages_total, torch.device("cpu"),
                                    group=group))
    loss_fn = nn.MSELoss()
    if args.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=args.microbatches,
                                           loss_fn=loss_fn)
    else:
        kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = kind(stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(params, lr=0.01)
    torch.manual_seed(1 + replica)  # each data-parallel replica its own batch
    x = torch.randn(BATCH, WIDTH)
    target = torch.randn(BATCH, WIDTH)
    first = 0 in indices
    last = stages_total - 1 in indices
    steps = []
    for _ in range(args.steps):
        _slept.seconds = 0.0
        cpu, delay = time.thread_time(), _run_delay_s()
        start = perf_counter()
        kwargs = {"target": target} if last else {}
        if first:
            schedule.step(x, **kwargs)
        else:
            schedule.step(**kwargs)
        optimizer.step()
        optimizer.zero_grad()
        duration = perf_counter() - start
        cpu, delay = time.thread_time() - cpu, _run_delay_s() - delay
        steps.append({"duration": duration, "own": _slept.seconds,
                      "bubble": duration - _slept.seconds, "cpu": cpu, "delay": delay,
                      "blocked": max(0.0, duration - _slept.seconds - cpu)})
    dist.barrier()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{global_rank}.json").write_text(json.dumps(
        {"rank": global_rank, "stages": indices, "pp": rank, "dp": replica, "steps": steps,
         "pid": os.getpid()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
