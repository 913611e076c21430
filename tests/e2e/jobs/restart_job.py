"""A 2-rank DDP job (gloo, CPU) with no gpumon code, for ``torchrun --max-restarts 1``: rank 0
saves a checkpoint every ``--every`` steps; on the first attempt rank ``--crash-rank`` dies in
the middle of step ``--crash-after + 1`` (``os._exit``); torchrun restarts both ranks, which
restore the last checkpoint and finish.

Each process writes its own timeline, independent of gpumon, to ``OUT/rank<R>.attempt<A>.jsonl``:
its start (the kernel's start time of the process, read by the job itself), each step's start
and end, each save and restore, and the moment it exits (on SIGTERM too: torchrun stops the
surviving rank that way). A step's device work is a sleep inside the model's forward, so two
shared cores cannot blur the timeline; a save and a restore write and read through a file
whose first write (read) waits ``--save-s`` (``--load-s``) seconds, as a slow disk would.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from timeline import Timeline
from torch.nn.parallel import DistributedDataParallel as DDP


class SlowFile(io.FileIO):
    """A file whose first write or read waits, as a slow or remote disk does."""

    def __init__(self, path: Path, mode: str, wait_s: float) -> None:
        super().__init__(path, mode)
        self._wait_s = wait_s

    def _once(self) -> None:
        if self._wait_s:
            time.sleep(self._wait_s)
            self._wait_s = 0.0

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._once()
        return super().write(data)

    def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
        self._once()
        return super().readinto(buffer)

    def read(self, size: int = -1) -> bytes:
        self._once()
        return super().read(size)


class Model(torch.nn.Module):
    def __init__(self, work_s: float) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                        torch.nn.Linear(512, 256))
        self.work_s = work_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.work_s)  # the device's work: the host thread waits
        return self.body(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--crash-after", type=int, default=50)
    parser.add_argument("--work-s", type=float, default=0.05)
    parser.add_argument("--save-s", type=float, default=1.0)
    parser.add_argument("--load-s", type=float, default=1.0)
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    args.out.mkdir(parents=True, exist_ok=True)
    timeline = Timeline(args.out / f"rank{rank}.attempt{attempt}.jsonl")

    def stopped(signum: int, frame: object) -> None:
        timeline.note("exit", why="sigterm")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # A store of this attempt's own: torchrun's store keeps the last attempt's addresses, which
    # a restarted rank could read before its peer has written its new one.
    dist.init_process_group("gloo", init_method=f"file://{args.out / f'store.{attempt}'}",
                            rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    model = DDP(Model(args.work_s))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    checkpoint = args.out / "checkpoint.pt"
    first = 1
    if checkpoint.exists():
        timeline.note("load_start")
        with SlowFile(checkpoint, "rb", args.load_s) as f:
            state = torch.load(f, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["step"] + 1
        timeline.note("load_end", step=state["step"])
    x = torch.randn(32, 256)
    try:
        train(args, attempt, rank, first, model, optimizer, x, timeline, checkpoint)
    except BaseException as exc:  # a peer's crash reaches the survivor as gloo's error
        timeline.note("exit", why=type(exc).__name__)
        os._exit(1)  # at once: the timeline's exit is the process's
    dist.destroy_process_group()
    timeline.note("exit", why="done")
    sys.stdout.flush()


def train(args: argparse.Namespace, attempt: int, rank: int, first: int, model: DDP,
          optimizer: torch.optim.Optimizer, x: torch.Tensor, timeline: Timeline,
          checkpoint: Path) -> None:
    for step in range(first, args.steps + 1):
        timeline.note("step_start", step=step)
        if attempt == 0 and rank == args.crash_rank and step == args.crash_after + 1:
            time.sleep(args.work_s * 3)  # dies in the middle of its step
            timeline.crash()
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        timeline.note("step_end", step=step)
        if rank == 0 and step % args.every == 0:
            timeline.note("save_start", step=step)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "step": step}
            with SlowFile(args.out / "checkpoint.tmp", "wb", args.save_s) as f:
                torch.save(state, f)
            os.replace(args.out / "checkpoint.tmp", checkpoint)
            timeline.note("save_end", step=step)
            timeline.note("save_done", step=step)


if __name__ == "__main__":
    main()
