"""A DeepSpeed training job on CPU (``DS_ACCELERATOR=cpu``, gloo) for the distributed tests,
launched by ``torch.distributed.run``: one engine per ZeRO stage asked for, trained in turn,
each reporting to its own monitor as run ``$GPUMON_RUN-z<stage>`` through ``mon.watch(engine)``.

Each rank writes what it measured itself, independently of gpumon, to
``OUT/rank<R>-z<stage>.json``. With ``--truth``, every reported step is followed by a twin
of it, timed here and not reported: the same engine, the same batch, with
``torch.distributed``'s collectives replaced by local stand-ins (an all-reduce does nothing,
an all-gather copies this rank's input into every slot of its output, a
reduce-scatter copies this rank's slice of its input out): the step's work without its
communication. Broadcasts stay real: ZeRO-3 checks with them that the ranks agree on the
modules it traces (a few integers). A barrier (untimed) re-aligns the ranks after each twin. So
``1 - t(twin) / t(step)`` is the share of the step communication costs. The twins run outside
any gpumon step (the loop makes its own steps with ``--user-steps``); their gradients are not
the synchronised ones, which at ``lr`` 1e-6 changes the weights by nothing a timing sees.

Without ``--user-steps`` the loop writes no ``mon.step``: the watcher makes one step per
optimizer step (gradient-accumulation boundary).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from time import perf_counter
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from gpumon.client import StepMonitor  # noqa: E402

# DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (a C++ op) at
# init_distributed, for inference_all_reduce alone, which training never calls: off, so that
# no compiler runs here.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", choices=("comm", "small"), default="comm")
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--overlap", action="store_true", help="overlap_comm")
    parser.add_argument("--truth", action="store_true", help="time a communication-free twin of every step")
    parser.add_argument("--user-steps", action="store_true", help="wrap each iteration in mon.step")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="each step ends waiting this long, as a host thread waits for its GPU")
    parser.add_argument("--no-watch", action="store_true")
    args = parser.parse_args()

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[int(os.environ["RANK"]) % os.cpu_count()]})
    deepspeed.init_distributed(dist_backend="gloo")
    _time_collectives()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    base = os.environ.get("GPUMON_RUN", "deepspeed-job")
    args.out.mkdir(parents=True, exist_ok=True)
    for stage in (int(s) for s in args.stages.split(",")):
        summary = train(args, stage, rank, world, f"{base}-z{stage}")
        (args.out / f"rank{rank}-z{stage}.json").write_text(json.dumps(summary))
    dist.destroy_process_group()


def train(args: argparse.Namespace, stage: int, rank: int, world: int, run: str) -> dict[str, Any]:
    torch.manual_seed(0)
    if args.model == "comm":  # 64 MiB of gradients against little compute at batch 2
        model: nn.Module = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
        batch, width = 2, 2048
    else:
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
        batch, width = 16, 256
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # cheap next to the all-reduce
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": args.gas,
        "zero_optimization": {"stage": stage, "overlap_comm": args.overlap},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(rank)

    def batches() -> Iterator[torch.Tensor]:
        while True:
            yield torch.randn(batch, width, generator=generator)

    def iteration(data: Iterator[torch.Tensor]) -> None:
        for _ in range(args.gas):
            loss = engine(next(data)).square().mean()
            engine.backward(loss)
            engine.step()
        # The device's work, which a loop reading its loss waits for at the step's end: a
        # sleep, which two shared cores neither stretch nor shrink between step and twin, and
        # with no collective in flight (a wait beside one counts as waiting for it).
        time.sleep(args.device_ms / 1000)

    data = batches()
    for _ in range(args.warmup):  # before the monitor: ZeRO-3's first steps gather and broadcast more
        iteration(data)
        if args.truth:
            with local_collectives(world, rank):
                iteration(data)
        dist.barrier()
    mon = StepMonitor(run=run)
    if not args.no_watch:
        mon.watch(engine)
    steps_s, twins_s, samples = [], [], []
    steps_cpu_s, twins_cpu_s, inside_s = [], [], []
    for _ in range(args.steps):
        t0, c0, i0 = perf_counter(), time.thread_time(), INSIDE[0]
        with mon.step(samples=batch * args.gas) if args.user_steps else nullcontext():
            iteration(data)
        steps_s.append(perf_counter() - t0)
        steps_cpu_s.append(time.thread_time() - c0)
        inside_s.append(INSIDE[0] - i0)
        samples.append(batch * args.gas)
        if args.truth:
            t0, c0 = perf_counter(), time.thread_time()
            with local_collectives(world, rank):
                iteration(data)
            twins_s.append(perf_counter() - t0)
            twins_cpu_s.append(time.thread_time() - c0)
            dist.barrier()
    mon.close()
    summary = {
        "rank": rank, "world": world, "stage": stage, "params": params, "gas": args.gas,
        "micro_batch": batch, "steps_s": steps_s, "twins_s": twins_s, "samples": samples,
        "stats": mon.stats.dropped, "extension_errors": mon.stats.extension_errors,
        "steps_counted": mon.stats.steps, "steps_cpu_s": steps_cpu_s, "twins_cpu_s": twins_cpu_s,
        "inside_s": inside_s,
    }
    engine.destroy() if hasattr(engine, "destroy") else None
    dist.barrier()
    return summary


class _Done:
    """The work of a local stand-in: complete when returned."""

    def wait(self, *_args: Any, **_kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _pair(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input) of a collective called either way."""
    output = args[0] if args else kwargs.get("output_tensor", kwargs.get("output"))
    input = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
    return output, input


def _all_gather_into_tensor(*args: Any, **kwargs: Any) -> Any:
    output, input = _pair(args, kwargs)
    for chunk in output.view(-1).chunk(output.numel() // max(1, input.numel())):
        chunk.copy_(input.view(-1))
    return _Done()


def _reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
    output, input = _pair(args, kwargs)
    output.view(-1).copy_(input.view(-1).chunk(dist.get_world_size())[dist.get_rank()])
    return _Done()


def _all_gather(*args: Any, **kwargs: Any) -> Any:
    outputs = args[0] if args else kwargs["tensor_list"]
    tensor = args[1] if len(args) > 1 else kwargs["tensor"]
    for out in outputs:
        out.copy_(tensor)
    return _Done()


def _nothing(*_a: Any, **_k: Any) -> Any:
    return _Done()


LOCAL: dict[str, Callable[..., Any]] = {
    "all_reduce": _nothing, "barrier": _nothing,
    "all_gather_into_tensor": _all_gather_into_tensor, "_all_gather_base": _all_gather_into_tensor,
    "reduce_scatter_tensor": _reduce_scatter_tensor, "_reduce_scatter_base": _reduce_scatter_tensor,
    "all_gather": _all_gather,
}


@contextmanager
def local_collectives(world: int, rank: int) -> Iterator[None]:
    """``torch.distributed``'s collectives (and those DeepSpeed's backend bound) as local
    stand-ins that communicate nothing."""
    from deepspeed.comm import comm as ds_comm

    backend = ds_comm.cdb
    saved = {name: getattr(dist, name) for name in LOCAL if hasattr(dist, name)}
    bound = (backend.all_gather_function, backend.reduce_scatter_function)
    for name in saved:
        setattr(dist, name, LOCAL[name])
    backend.all_gather_function = _all_gather_into_tensor
    backend.reduce_scatter_function = _reduce_scatter_tensor
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(dist, name, function)
        backend.all_gather_function, backend.reduce_scatter_function = bound


INSIDE = [0.0]


def _time_collectives() -> None:
    """Sum the seconds the training thread spends inside DeepSpeed's collective calls and in
    waits on their work (``OUT``'s ``inside_s``, per reported step), above gpumon's wrappers
    and independent of them."""
    import functools
    import threading

    from deepspeed.comm import comm as ds_comm
    from torch._C._distributed_c10d import Work

    main = threading.get_ident()

    depth = [0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*a: Any, **k: Any) -> Any:
            if threading.get_ident() != main or depth[0]:  # a blocking call waits on its work
                return fn(*a, **k)
            t0 = perf_counter()
            depth[0] += 1
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                INSIDE[0] += perf_counter() - t0
        return inner

    backend = ds_comm.cdb
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
                 "broadcast", "reduce_scatter", "all_reduce_coalesced"):
        if hasattr(backend, name):
            setattr(backend, name, timed(getattr(backend, name)))
    Work.wait = timed(Work.wait)


if __name__ == "__main__":
    main()
