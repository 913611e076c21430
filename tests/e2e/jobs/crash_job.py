"""A two-rank DDP job (gloo, under ``torch.distributed.run``) whose rank 1 dies in the middle
of training, for the step-ring tests: its last steps are the ones a dying process had not sent.

Each rank appends every completed step to ``OUT/rank<R>.steps`` and flushes it before the next
begins: the ground truth, measured by the job itself. Steps are device-like (a 20 ms sleep
beside a small DDP step); the last ``--burst`` steps before the death are quick and sync no
gradients (``no_sync``), so the hook's sender, which sends every 0.25 s, has not sent them yet
when the rank dies right after the last. ``--die``:

* ``exit``: ``os._exit(3)``;
* ``kill``: writes its pid to ``OUT/rank1.dying`` and waits holding the interpreter's lock (a C
  sleep through ``ctypes.pythonapi``, so the sender thread cannot send either) for the test's
  SIGKILL;
* ``segv``: reads address 0 (``ctypes.string_at(0)``).

``--hooked`` times the steps with ``StepMonitor``; without it the job has nothing of gpumon
in it (for ``gpumon run``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def die(how: str, out: Path) -> None:
    if how == "exit":
        os._exit(3)
    if how == "kill":
        (out / "rank1.dying").write_text(str(os.getpid()))
        ctypes.pythonapi.sleep(ctypes.c_uint(120))  # holds the GIL: nothing else runs
        os._exit(4)
    ctypes.string_at(0)
    os._exit(5)  # not reached


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--die", choices=("exit", "kill", "segv"), required=True)
    parser.add_argument("--at", type=int, default=50, help="rank 1 dies after this many steps")
    parser.add_argument("--burst", type=int, default=6)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--hooked", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = None
    if args.hooked:
        from gpumon.client import StepMonitor

        mon = StepMonitor()
    truth = open(args.out / f"rank{rank}.steps", "a")  # noqa: SIM115 - held for the whole run
    x = torch.randn(4, 64)
    for i in range(args.steps):
        quick = args.at - args.burst <= i < args.at
        step: AbstractContextManager[object] = mon.step() if mon is not None else nullcontext()
        with step:
            with model.no_sync() if quick else nullcontext():
                loss = model(x).square().mean()
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if not quick:
                time.sleep(0.02)  # device-like work
        truth.write(f"{i}\n")
        truth.flush()
        if rank == 1 and i == args.at - 1:
            die(args.die, args.out)
    truth.close()
    if mon is not None:
        mon.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
