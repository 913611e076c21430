"""A small DDP job on CPU (gloo) that stops the way real runs stop, for the stall tests;
launched by ``torch.distributed.run``.

Each step: its batch through ``mon.loader`` (the ``data`` phase), forward, backward (DDP's
all-reduce, watched), optimizer, and ``--work-ms`` of sleep standing for device work. What
the job itself knows about its stop is written to ``OUT/rank<R>.json`` the moment it happens
(the unix time, its pid, its steps), independently of gpumon. Scenarios (``--scenario``):

- ``data``: ``--rank`` blocks for good in ``read_shard()``, in its data iterator, after
  ``--stop-after`` steps; its peers then wait in the next all-reduce.
- ``lock``: ``--rank`` deadlocks inside forward, in ``apply_adapter()``, on a lock never
  released, after ``--stop-after`` steps.
- ``skip``: ``--rank`` runs step ``--stop-after`` under ``no_sync()`` (its peers do not), then
  after its last step waits for good in ``upload_checkpoint()``; gloo pairs its later
  all-reduces with its peers' earlier ones, so its peers reach the end one all-reduce short.
- ``gil``: ``--rank`` starts a thread that holds the interpreter's lock for good (a regular
  expression that never finishes), after ``--stop-after`` steps.
- ``slow``: a healthy run whose every rank takes one step ``--slow-ms`` long (a checkpoint
  save) at step ``--stop-after``, then ends normally.
- ``eval``: a healthy run whose every rank, after ``--stop-after`` steps, evaluates for
  ``--eval-s`` seconds (batches from a DataLoader, forwards under ``no_grad``, no step), then
  trains on.
- ``slowed``: ``--rank``'s device work takes half as long again from step ``--stop-after`` on
  (inside its forward), so its steps' own work is 1.5× its peers'; they wait for it.
- ``normal``: a healthy run as a long one goes: rank 0 saves a checkpoint every
  ``--checkpoint-every`` steps (``torch.save``, the save taking ``--checkpoint-s`` in all, inside
  its step; its peers wait for it in the next all-reduce), and every rank evaluates once, for
  ``--eval-s`` seconds, after ``--stop-after`` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpumon.client import StepMonitor

FOREVER = threading.Event()  # never set


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", choices=("data", "lock", "skip", "gil", "slow", "eval", "slowed",
                                               "normal"), required=True)
    parser.add_argument("--rank", type=int, default=1, help="the rank that stops")
    parser.add_argument("--stop-after", type=int, default=15)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--work-ms", type=float, default=50.0)
    parser.add_argument("--slow-ms", type=float, default=300.0)
    parser.add_argument("--eval-s", type=float, default=60.0)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--checkpoint-s", type=float, default=5.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    culprit = rank == args.rank
    model = Adapted(culprit and args.scenario == "lock", args.stop_after, args.out, rank)
    ddp = DDP(model)
    mon = StepMonitor()
    mon.watch(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    blocks = culprit and args.scenario == "data"
    done = 0
    for batch in mon.loader(Shards(args.steps, args.stop_after if blocks else -1, args.out, rank)):
        x, y = batch
        skip = culprit and args.scenario == "skip" and done == args.stop_after
        if culprit and args.scenario == "gil" and done == args.stop_after:
            _note(args.out, rank, "gil", done)
            threading.Thread(target=hold_the_interpreter, daemon=True).start()
        with mon.step(samples=len(x)):
            with ddp.no_sync() if skip else nullcontext():
                with mon.phase("forward"):
                    loss = loss_fn(ddp(x), y)
                    if culprit and args.scenario == "slowed" and done >= args.stop_after:
                        if done == args.stop_after:
                            _note(args.out, rank, "slowed", done, name="slowed")
                        time.sleep(args.work_ms / 2e3)  # its device work, half as long again
                with mon.phase("backward"):
                    loss.backward()
            with mon.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            time.sleep(args.work_ms / 1e3)
            if args.scenario == "slow" and done == args.stop_after:
                time.sleep(args.slow_ms / 1e3)  # a checkpoint save on every rank
            if args.scenario == "normal" and rank == 0 and done > 0 and done % args.checkpoint_every == 0:
                save_checkpoint(ddp, opt, args.out, args.checkpoint_s)
        done += 1
        _note(args.out, rank, "steps", done)
        if args.scenario in ("eval", "normal") and done == args.stop_after:
            evaluate(ddp, args.eval_s, args.out, rank, done)
    if culprit and args.scenario == "skip":
        upload_checkpoint(args.out, rank, done)
    mon.close()
    dist.destroy_process_group()


class Adapted(nn.Module):
    """A linear model whose forward may deadlock in user code (``apply_adapter``)."""

    def __init__(self, deadlock: bool, after_steps: int, out: Path, rank: int) -> None:
        super().__init__()
        self._out, self._rank = out, rank
        self.linear = nn.Linear(64, 64)
        self._deadlock = deadlock
        self._after = after_steps
        self._calls = 0
        self._lock = threading.Lock()
        self.eval_work_s = 0.05

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._calls += 1
        if not torch.is_grad_enabled():
            time.sleep(self.eval_work_s)  # an evaluation's device work, inside its forward
        return self.apply_adapter(self.linear(x))

    def apply_adapter(self, h: torch.Tensor) -> torch.Tensor:
        if self._deadlock and self._calls > self._after:
            _note(self._out, self._rank, "lock", self._after)
            self._lock.acquire()
            self._lock.acquire()  # never released: the second acquire waits for good
        return torch.relu(h)


class Shards:
    """Batches read from "shards"; ``read_shard`` never returns after ``block_after`` batches."""

    def __init__(self, count: int, block_after: int, out: Path, rank: int) -> None:
        self.count, self.block_after, self.out, self.rank = count, block_after, out, rank

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.count):
            if i == self.block_after:
                self.read_shard(i)
            yield torch.randn(32, 64), torch.randn(32, 64)

    def read_shard(self, index: int) -> None:
        _note(self.out, self.rank, "data", index)
        FOREVER.wait()  # a storage read that never returns


def evaluate(model: nn.Module, seconds: float, out: Path, rank: int, steps: int) -> None:
    """An evaluation pass: batches and forwards under ``no_grad`` for ``seconds``, no step."""
    _note(out, rank, "eval", steps)
    loader = torch.utils.data.DataLoader(torch.randn(256, 64), batch_size=32)
    end = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            for batch in loader:
                model(batch)
    _note(out, rank, "evaluated", steps)


def save_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, out: Path, seconds: float) -> None:
    """Rank 0's checkpoint: the state saved, and the save taking ``seconds`` in all (a large
    model's write to shared storage)."""
    end = time.monotonic() + seconds
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out / "checkpoint.pt")
    time.sleep(max(0.0, end - time.monotonic()))


def upload_checkpoint(out: Path, rank: int, steps: int) -> None:
    _note(out, rank, "skip", steps)
    FOREVER.wait()


def hold_the_interpreter() -> None:
    re.match(r"(a+)+$", "a" * 64 + "!")  # exponential backtracking, without releasing the GIL


def _note(out: Path, rank: int, what: str, steps: int, name: str | None = None) -> None:
    """The job's own record of where it is, written before it stops (read by the tests): in
    ``rank<R>.json``, or a file ``name`` of its own that the next steps' notes leave alone."""
    path = out / f"{name or f'rank{rank}'}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"what": what, "t": time.time(), "steps": steps, "pid": os.getpid()}))
    tmp.replace(path)


if __name__ == "__main__":
    main()
