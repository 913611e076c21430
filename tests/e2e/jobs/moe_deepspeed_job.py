"""A DeepSpeed-MoE layer (``deepspeed.moe.layer.MoE``, top-2 gating) trained on CPU
(``DS_ACCELERATOR=cpu``, gloo), unchanged (no gpumon import), so that it runs under
``gpumon run``; the expert-parallel size is the world's.

Each rank writes to ``OUT/rank<R>.json`` the tokens its gate routed to each expert, read from
the gate's own output each step (its ``exp_counts``, which the layer keeps as
``MOELayer.exp_counts``), independently of gpumon, and the window's figures over its last
``--window`` steps.

    moe_deepspeed_job.py --out OUT [--steps N] [--window W]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from torch import nn

# DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (a C++ op) at
# init_distributed, for inference_all_reduce alone, which training never calls: off, so that
# no compiler runs here.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

EXPERTS = 4
WIDTH = 16


def figures(counts: list[int]) -> dict[str, float]:
    mean = sum(counts) / len(counts)
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts))
    return {"max_ratio": max(counts) / mean, "cv": std / mean, "dead": counts.count(0),
            "tokens": sum(counts)}


class Model(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.moe = MoE(hidden_size=WIDTH, expert=nn.Linear(WIDTH, WIDTH), num_experts=EXPERTS,
                       ep_size=ep_size, k=2, capacity_factor=2.0, min_capacity=4)
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, l_aux, _ = self.moe(self.inp(x))
        return self.out(hidden).mean(), l_aux


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model(ep_size=world)
    with torch.no_grad():  # a skewed gate: expert 0 favoured
        model.moe.deepspeed_moe.gate.wg.weight[0] *= 5.0
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)  # each rank its own batches
    history: list[list[int]] = []
    for _ in range(args.steps):
        x = torch.randn(8, 12, WIDTH)
        loss, l_aux = model(x)
        (loss + 0.01 * l_aux).backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append([int(c) for c in model.moe.deepspeed_moe.exp_counts.tolist()])
    window = history[-args.window:]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(
        {"window": len(window), "layer": figures([sum(s[e] for s in window) for e in range(EXPERTS)]),
         "pid": os.getpid()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
