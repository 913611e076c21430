"""The job ``stall.py`` starts: a watched world-size-1 DDP loop that steps, then stalls.

    python stall_job.py --case device|host --device cuda|cpu

``device`` (CUDA only): a kernel spinning for minutes is queued before the 21st backward, so
DDP's NCCL all-reduce waits behind it on the GPU; the host thread waits for the loss in
``wait_for_gpu``. ``host``: the 21st step blocks in ``load_from_host`` with the GPU idle.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpumon.client import StepMonitor

STEPS_BEFORE = 20
SPIN_CYCLES = 1 << 40  # minutes of a spinning kernel on any GPU


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("device", "host"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))
    device = torch.device(args.device)
    model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = StepMonitor(rank=0, world=1, local_rank=0)
    mon.watch(model, optimizer)
    x = torch.randn(64, 256, device=device)
    for step in range(STEPS_BEFORE + 1):
        stall = step == STEPS_BEFORE
        with mon.step():
            with mon.phase("forward"):
                if stall and args.case == "host":
                    load_from_host()
                loss = model(x).square().mean()
            with mon.phase("backward"):
                if stall and args.case == "device":
                    torch.cuda._sleep(SPIN_CYCLES)  # the all-reduce queues behind this kernel
                loss.backward()
            with mon.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
                wait_for_gpu(loss)
        print(f"step {step}", flush=True)


def load_from_host() -> None:
    """A host-side wait that never ends (a read from a hung filesystem)."""
    threading.Event().wait()


def wait_for_gpu(loss: Any) -> float:
    """Wait for the loss the way a loop logging it does, without holding the interpreter."""
    if loss.is_cuda:
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            time.sleep(0.005)
    return float(loss)


if __name__ == "__main__":
    main()
