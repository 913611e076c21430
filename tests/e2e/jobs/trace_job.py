"""Small jobs with nothing of gpumon in them, for the trace tests (CPU, gloo, under
``gpumon run``): ``ddp`` (under ``torch.distributed.run``) takes batches from a DataLoader
whose dataset waits (input); ``deepspeed`` (under the ``deepspeed`` launcher,
``DS_ACCELERATOR=cpu``) is a ZeRO-1 engine, two micro-batches per optimizer step. Both do
device-like work (a sleep) after forward, rank 1 more of it than rank 0 (its peer then waits in
the collectives). They run until ``--stop`` exists (or ``--max-steps``), then write each
rank's losses to ``OUT/rank<R>.json``."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Waiting(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.generator = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.wait_s)
        return torch.randn(64, generator=self.generator)


def deepspeed_engine(model: nn.Module) -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # The CPU accelerator compiles a shared-memory all-reduce op at init_distributed for
    # inference alone (minutes on two cores): off.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("ddp", "deepspeed"))
    parser.add_argument("--local_rank", type=int, default=None, help="given by the deepspeed launcher")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--slow-rank-ms", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    if args.framework == "deepspeed":
        engine = deepspeed_engine(mlp)
    else:
        dist.init_process_group("gloo")
        model = DistributedDataParallel(mlp)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    rank = dist.get_rank()
    loader: Any = torch.utils.data.DataLoader(Waiting(0.0005), batch_size=4)
    if args.framework == "deepspeed":
        loader = itertools.count()  # the engine's micro-batches are made below
    losses = []
    device_s = 0.004 + (args.slow_rank_ms / 1000 if rank == 1 else 0.0)
    generator = torch.Generator().manual_seed(rank)
    for step, x in enumerate(loader):
        if args.framework == "deepspeed":
            for _ in range(2):
                loss = engine(torch.randn(4, 64, generator=generator)).square().mean()
                time.sleep(device_s / 2)  # where a GPU would keep the host waiting for its kernels
                engine.backward(loss)
                engine.step()
        else:
            loss = model(x).square().mean()
            time.sleep(device_s)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        stop = torch.tensor([float(args.stop.exists() or step + 1 >= args.max_steps)])
        dist.all_reduce(stop)  # every rank stops after the same step
        if stop.item():
            break
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
