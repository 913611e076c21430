"""A training loop with an evaluation pass of cheap forwards, as it runs on a GPU: each forward
is launched at once and the host then waits (here 50 ms asleep) outside any module call, as it
would in ``.item()`` or a metric's sync. Then training again, then a forward that never
returns. Run under ``gpumon run`` unchanged, or with ``--hooked`` its steps in a
``StepMonitor`` of its own; it writes what it is doing, with the time, to the file named by its
first argument.

    eval_job.py NOTES TRAIN_STEPS EVAL_BATCHES [--hooked]
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch


def note(path: str, what: str) -> None:
    with open(path, "a") as out:
        out.write(json.dumps({"what": what, "t": time.time()}) + "\n")


class NeverReturns(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        threading.Event().wait()
        return x


def main() -> None:
    notes, train_steps, eval_batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mon = None
    if "--hooked" in sys.argv:
        from gpumon.client import StepMonitor

        mon = StepMonitor()
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, v = torch.randn(32, 64), torch.randn(32, 64)

    def train(steps: int) -> None:
        for _ in range(steps):
            if mon is None:
                step()
            else:
                with mon.step(samples=len(x)):
                    step()

    def step() -> None:
        loss = m(x).square().mean()
        loss.backward()
        time.sleep(0.05)  # the device's work
        opt.step()
        opt.zero_grad()

    train(train_steps)
    note(notes, "evaluating")
    with torch.no_grad():
        for _ in range(eval_batches):
            m(v)
            time.sleep(0.05)  # waiting on the device, outside any module call
    note(notes, "training")
    train(train_steps)
    note(notes, "hung")
    with torch.no_grad():
        NeverReturns()(v)


if __name__ == "__main__":
    main()
