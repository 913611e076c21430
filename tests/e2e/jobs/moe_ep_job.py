"""A torch-native expert-parallel MoE layer on CPU (gloo, two ranks), its routing skewed by
construction, reporting through ``StepMonitor`` with ``mon.expert_load``.

Each rank holds ``EXPERTS // world`` of the experts (rank 0 experts 0 and 1, rank 1 experts 2
and 3). Every rank routes its ``TOKENS`` tokens top-1 by a fixed table of shares, so that each
step's counts are known exactly: expert 0 gets 40 of every 64 tokens, experts 1 and 2 12 each,
expert 3 none. The tokens go to their experts' ranks by ``all_to_all_single`` (the split sizes
first, then the tokens) and come back the same way. An expert's work is a small matmul and a
sleep per token it receives (device-like work, the same on any host), so the rank that holds
the busy experts computes while its peer waits for it in the all-to-all that brings the
tokens back.

Each rank writes to ``OUT/rank<R>.json`` what it routed and sent, independently of gpumon:
its tokens per expert each step, and per step the all-to-alls it issued and their bytes (each
call's input, as nccl-tests size an all-to-all), and its own compute time per step.

    moe_ep_job.py --out OUT [--steps N] [--ms-per-token MS]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gpumon.client import StepMonitor

EXPERTS = 4
TOKENS = 64
WIDTH = 32
SHARES = [40, 12, 12, 0]
"""Tokens of every ``TOKENS`` each expert gets (top-1): skewed to expert 0, expert 3 dead."""


class ExpertLayer(nn.Module):
    def __init__(self, local: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(local))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ms-per-token", type=float, default=0.5)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})  # before gloo starts its threads
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    local = EXPERTS // world
    torch.manual_seed(rank)
    layer = ExpertLayer(local)
    mon = StepMonitor(parallel={"ep": rank})
    mon.watch(layer)
    expert_of = torch.tensor([e for e, share in enumerate(SHARES) for _ in range(share)])
    calls: list[list[int]] = []
    counts_sent: list[list[int]] = []
    own_s: list[float] = []
    for _ in range(args.steps):
        with mon.step():
            tokens = torch.randn(TOKENS, WIDTH)
            order = torch.argsort(expert_of, stable=True)
            routed = tokens[order]
            per_expert = torch.bincount(expert_of, minlength=EXPERTS)
            mon.expert_load(0, per_expert)
            send_splits = per_expert.view(world, local).sum(1)
            recv_splits = torch.empty_like(send_splits)
            sizes: list[int] = []
            dist.all_to_all_single(recv_splits, send_splits)
            sizes.append(send_splits.numel() * send_splits.element_size())
            received = torch.empty(int(recv_splits.sum()), WIDTH)
            dist.all_to_all_single(received, routed, recv_splits.tolist(), send_splits.tolist())
            sizes.append(routed.numel() * routed.element_size())
            start = time.perf_counter()
            out = layer.experts[0](received)  # the work is in the sleep: one matmul stands for it
            time.sleep(args.ms_per_token * received.shape[0] / 1000)
            own_s.append(time.perf_counter() - start)
            back = torch.empty_like(routed)
            dist.all_to_all_single(back, out.detach(), send_splits.tolist(), recv_splits.tolist())
            sizes.append(out.numel() * out.element_size())
            calls.append(sizes)
            counts_sent.append(per_expert.tolist())
    mon.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(
        {"counts": counts_sent, "all_to_all_bytes": calls, "compute_s": own_s}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
