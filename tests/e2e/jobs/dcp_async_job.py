"""A job with no gpumon code that saves with ``torch.distributed.checkpoint.async_save`` every
``--every`` steps, writing through a slow disk (``--write-s`` seconds of waiting in the
background writer) while the next steps run; before each save it waits for the previous one,
as a job must. With ``--crash-at N`` it dies at the end of step N, its last save still writing.

Its own timeline (``timeline.py``): each step's start and end, each save's call and return (the
time it held the training thread), the moment its future says it completed, and its exit. A
step's device work is a sleep as its forward begins.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from timeline import Timeline


class SlowWriter(dcp.FileSystemWriter):
    """Writes as to a slow disk: its background write waits first."""

    write_s = 0.0

    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(self.write_s)
        return super().write_data(plan, planner)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--crash-at", type=int, default=0)
    parser.add_argument("--work-s", type=float, default=0.05)
    parser.add_argument("--write-s", type=float, default=2.0)
    args = parser.parse_args()
    timeline = Timeline(args.out / "attempt0.jsonl")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.out / 'store'}", rank=0,
                            world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 2048))
    model.register_forward_pre_hook(lambda module, inputs: time.sleep(args.work_s))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 2048)
    SlowWriter.write_s = args.write_s
    pending = None
    for step in range(1, args.steps + 1):
        timeline.note("step_start", step=step)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        timeline.note("step_end", step=step)
        if step == args.crash_at:
            timeline.crash()
        if step % args.every == 0:
            if pending is not None:
                pending.result()
            timeline.note("save_start", step=step)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            pending = dcp.async_save(state, storage_writer=SlowWriter(str(args.out / f"ckpt{step}")))
            timeline.note("save_end", step=step)
            pending.add_done_callback(lambda f, s=step: timeline.note("save_done", step=s))
    if pending is not None:
        pending.result()
    dist.destroy_process_group()
    timeline.note("exit", why="done")


if __name__ == "__main__":
    main()
