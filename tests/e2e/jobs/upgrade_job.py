"""A small DDP job (CPU, gloo) with nothing of gpumon in it, that trains until told to stop,
for the agent-upgrade test: it runs through the agent's restarts, however long they take.

Each step is a forward, a backward (DDP's all-reduce), an optimizer step and ``--step-ms`` of
device-like work (a sleep). Every rank checks ``--stop-file`` each step and the ranks agree
(an all-reduce of the flag), so they stop after the same step. Each rank writes
``OUT/rank<R>.json`` with the optimizer steps it made: the count the agents must account for.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--step-ms", type=float, default=40.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    steps = 0
    while True:
        loss = model(torch.randn(16, 64, generator=generator)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        time.sleep(args.step_ms / 1000)
        stop = torch.tensor([1.0 if args.stop_file.exists() else 0.0])
        dist.all_reduce(stop)
        if stop.item() > 0:
            break
    dist.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"optimizer_steps": steps}))


if __name__ == "__main__":
    main()
