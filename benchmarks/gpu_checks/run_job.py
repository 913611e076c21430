"""An unmodified training script for the ``gpumon run`` check: nothing of gpumon in it.

    python run_job.py --device cuda --steps 60 [--warmup 10] [--width 2048] [--layers 4]

An MLP in bf16 autocast with AdamW, batches from a DataLoader over in-memory tensors moved to
the device. Prints one JSON line: the optimizer steps taken and the steps a second after the
warm-up (the device synchronised at both ends).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    size = args.batch * 16
    data = TensorDataset(torch.randn(size, args.width), torch.randint(0, 10, (size,)))
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)
    loss_fn = nn.CrossEntropyLoss()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    steps, t0 = 0, 0.0
    while steps < args.steps:
        for x, y in loader:
            if steps == args.warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast:
                loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            if steps == args.steps:
                break
    if device.type == "cuda":
        torch.cuda.synchronize()
    timed = args.steps - args.warmup
    print(json.dumps({"steps": steps, "steps_per_s": timed / (time.perf_counter() - t0),
                      "loss": float(loss.item())}), flush=True)


if __name__ == "__main__":
    main()
