"""A training loop that knows nothing of gpumon, for ``gpumon run``'s tests: it prints one line
per step (its loss), then does what its first argument says: ``exit N`` (exit status N),
``wait`` (print ``ready`` and train on until a signal ends it), ``spawn`` (train the same in a
``multiprocessing`` spawned child and a DataLoader with two spawned workers too)."""

import multiprocessing
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Scaled(Dataset):  # type: ignore[type-arg]
    """Samples made by a module, as a transform would be: it runs in the worker processes."""

    def __init__(self) -> None:
        torch.manual_seed(1)
        self.transform = nn.Linear(8, 8)
        self.data = torch.randn(64, 8)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        with torch.no_grad():
            return self.transform(self.data[i])


def train(steps: int, workers: int = 0) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    context = "spawn" if workers else None
    data = DataLoader(Scaled(), batch_size=8, num_workers=workers, multiprocessing_context=context)
    step = 0
    while step < steps:
        for x in data:
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"{os.environ.get('ROLE', 'main')} step {step} loss {loss.item():.6f}", flush=True)
            step += 1
            if step == steps:
                return


def child() -> None:
    os.environ["ROLE"] = "child"
    train(4)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "exit":
        train(3)
        sys.exit(int(sys.argv[2]))
    elif what == "wait":
        train(2)
        print("ready", flush=True)
        train(10**9)
    elif what == "spawn":
        process = multiprocessing.get_context("spawn").Process(target=child)
        process.start()
        process.join()
        train(4, workers=2)
        sys.exit(process.exitcode)
