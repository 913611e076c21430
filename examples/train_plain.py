"""The training loop of ``train_cpu.py`` with nothing of gpumon in it: what ``gpumon run``
watches as it is.

    gpumon run --socket /tmp/gpumon.sock -- python examples/train_plain.py --steps 200
    gpumon run -- python examples/train_plain.py --input-bound   # waiting for input dominates

Same model, data and flags as ``train_cpu.py``; the last line printed is JSON:
``{"samples_per_second": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

FEATURES = 256
CLASSES = 10
SLOW_ITEM_S = 0.0005


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic samples that take ``SLOW_ITEM_S`` each to produce."""

    def __init__(self, size: int) -> None:
        self._data = TensorDataset(torch.randn(size, FEATURES), torch.randint(0, CLASSES, (size,)))

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(SLOW_ITEM_S)
        return self._data[index]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; exits with a message on bad flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5, help="steps not counted in the throughput")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--input-bound", action="store_true", help="slow Dataset: waiting on input dominates")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and below --steps")
    return args


@dataclass
class Job:
    """A model, its optimizer and loss, and an endless supply of batches."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: nn.Module
    data: Iterator[tuple[torch.Tensor, torch.Tensor]]


def make_job(args: argparse.Namespace) -> Job:
    """The MLP, AdamW and the data ``args`` describe (seeded: every job starts the same)."""
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = nn.Sequential(nn.Linear(FEATURES, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                          nn.ReLU(), nn.Linear(args.hidden, CLASSES))
    size = args.batch_size * 32
    dataset: Dataset[tuple[torch.Tensor, torch.Tensor]] = (
        SlowDataset(size) if args.input_bound
        else TensorDataset(torch.randn(size, FEATURES), torch.randint(0, CLASSES, (size,))))
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        drop_last=True)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from loader

    return Job(model, torch.optim.AdamW(model.parameters(), lr=1e-3), nn.CrossEntropyLoss(), batches())


def train(job: Job, steps: int) -> float:
    """Run ``steps`` training steps; the last loss."""
    loss = torch.zeros(())
    for x, y in islice(job.data, steps):
        loss = job.loss_fn(job.model(x), y)
        loss.backward()
        job.optimizer.step()
        job.optimizer.zero_grad()
    return float(loss.item())


def main() -> None:
    args = parse_args()
    job = make_job(args)
    train(job, args.warmup)
    timed_from = time.perf_counter()
    loss = train(job, args.steps - args.warmup)
    elapsed = time.perf_counter() - timed_from
    print(json.dumps({"samples_per_second": (args.steps - args.warmup) * args.batch_size / elapsed,
                      "steps": args.steps, "final_loss": loss}))


if __name__ == "__main__":
    main()
