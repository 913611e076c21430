"""A training loop that knows nothing of gpumon: ``STEPS`` optimizer steps of a small CPU model,
each padded to ``PERIOD_S`` seconds with a sleep (the device's share of a step), printing
``step N`` after each. Arguments: STEPS PERIOD_S [GATE]: with GATE, it prints ``ready`` once
set up and steps only once the file GATE exists (so two jobs can step at the same time)."""

import os
import sys
import time

import torch
from torch import nn

steps, period_s = int(sys.argv[1]), float(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 16)
if len(sys.argv) > 3:
    print("ready", flush=True)
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.01)
for step in range(steps):
    started = time.perf_counter()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(max(0.0, period_s - (time.perf_counter() - started)))
    print(f"step {step}", flush=True)
