"""A training step compiled whole (forward, loss and backward in one ``torch.compile``d
function), run with or without ``gpumon run``'s hooks (``--hooks``), the compiler first imported
by that ``torch.compile``: prints the graph breaks the compiler counted and, with the hooks,
the phases of each step they recorded, as JSON."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpumon.client import StepMonitor
from gpumon.client.autowatch import hooks
from gpumon.client.core.transport import MemoryTransport
from tests.helpers import steps_of

transport = MemoryTransport()
if "--hooks" in sys.argv:
    hooks.make_monitor = lambda: StepMonitor(run="compiled", transport=transport, rank=0, world=1)
    assert hooks.install()
    hooks.take_out()  # out and in again: the wrappers put in last are the ones left to Python
    assert hooks.install()
assert "torch._dynamo" not in sys.modules  # what follows imports it
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8)


@torch.compile(backend="eager")
def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


for x, y in data:
    forward_backward(x, y)
    optimizer.step()
    optimizer.zero_grad()

from torch._dynamo.utils import counters  # noqa: E402 (loaded by the compile above)

finder = hooks._state.finder
if finder is not None:
    finder.monitor.flush()
print(json.dumps({"graph_breaks": sorted(counters["graph_break"]),
                  "phases": [sorted(s.phases_s) for s in steps_of(transport)]}))
