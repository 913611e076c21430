"""A small DDP job with nothing of gpumon in it, for the trace tests (CPU, gloo, under
``torch.distributed.run`` and ``gpumon run``): batches from a DataLoader whose dataset waits
(input), forward with device-like work (a sleep), rank 1 doing more of it than rank 0 (its
peer then waits in the all-reduce), an optimizer step. It runs until ``--stop`` exists (or
``--max-steps``), then writes each rank's losses to ``OUT/rank<R>.json``."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--slow-rank-ms", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Waiting(0.0005), batch_size=4)
    losses = []
    device_s = 0.004 + (args.slow_rank_ms / 1000 if rank == 1 else 0.0)
    for step, x in enumerate(loader):
        loss = model(x).square().mean()
        time.sleep(device_s)  # where a GPU would keep the host waiting for its kernels
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
