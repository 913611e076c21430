"""A real PyTorch training loop on the CPU (an MLP on synthetic data), instrumented with gpumon.

    python examples/train_cpu.py --steps 200 --run demo --socket /tmp/gpumon.sock
    python examples/train_cpu.py --input-bound      # a slow Dataset: the data phase dominates
    python examples/train_cpu.py --no-hook          # the same loop without gpumon, for comparison

The last line printed is JSON: ``{"samples_per_second": ..., ...}``.
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

from gpumon.client import StepMonitor

FEATURES = 256
CLASSES = 10
SLOW_ITEM_S = 0.0005
"""Per-sample delay of the input-bound Dataset (a slow decoder or disk)."""


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic samples that take ``SLOW_ITEM_S`` each to produce."""

    def __init__(self, size: int) -> None:
        self._data = TensorDataset(torch.randn(size, FEATURES), torch.randint(0, CLASSES, (size,)))

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(SLOW_ITEM_S)
        return self._data[index]


def make_loader(args: argparse.Namespace) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    """In-memory data by default; ``--input-bound`` makes every sample slow to load."""
    size = args.batch_size * 32
    if args.input_bound:
        dataset: Dataset[tuple[torch.Tensor, torch.Tensor]] = SlowDataset(size)
    else:
        dataset = TensorDataset(torch.randn(size, FEATURES), torch.randint(0, CLASSES, (size,)))
    return DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True
    )


def batches(
    loader: DataLoader[tuple[torch.Tensor, torch.Tensor]],
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches without end, going round the loader as many epochs as needed."""
    while True:
        yield from loader


@dataclass
class Job:
    """A model, its optimizer and an endless supply of batches."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: nn.Module
    data: Iterator[tuple[torch.Tensor, torch.Tensor]]
    flops_per_step: float


def make_job(args: argparse.Namespace) -> Job:
    """The MLP, AdamW and the data ``args`` describe (seeded: every job starts the same)."""
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = nn.Sequential(
        nn.Linear(FEATURES, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, CLASSES),
    )
    params = sum(p.numel() for p in model.parameters())
    return Job(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        loss_fn=nn.CrossEntropyLoss(),
        data=batches(make_loader(args)),
        flops_per_step=6.0 * params * args.batch_size,  # forward 2·params, backward 4·params per sample
    )


def train(job: Job, steps: int, monitor: StepMonitor | None = None) -> float:
    """Run ``steps`` training steps, timed by ``monitor`` when given; the last loss."""
    model, optimizer, loss_fn = job.model, job.optimizer, job.loss_fn
    data = islice(job.data, steps)
    loss = torch.zeros(())
    if monitor is None:
        for x, y in data:
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        for x, y in monitor.loader(data):
            with monitor.step(samples=len(x), flops=job.flops_per_step):
                with monitor.phase("forward"):
                    loss = loss_fn(model(x), y)
                with monitor.phase("backward"):
                    loss.backward()
                with monitor.phase("optimizer"):
                    optimizer.step()
                    optimizer.zero_grad()
    return float(loss.item())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; exits with a message on bad flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5, help="steps not counted in the throughput")
    parser.add_argument("--run", default=None,
                        help="run name (default $GPUMON_RUN, else the job's, else the script's)")
    parser.add_argument("--socket", default=None, help="agent socket (default $GPUMON_SOCKET)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--input-bound", action="store_true", help="slow Dataset: waiting on input dominates")
    parser.add_argument("--no-hook", action="store_true", help="the same loop without gpumon")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and below --steps")
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Train, print a summary and return it."""
    args = parse_args(argv)
    job = make_job(args)
    monitor = None if args.no_hook else StepMonitor(args.run, socket_path=args.socket)
    train(job, args.warmup, monitor)
    timed_from = time.perf_counter()
    loss = train(job, args.steps - args.warmup, monitor)
    elapsed = time.perf_counter() - timed_from
    summary: dict[str, object] = {
        "samples_per_second": (args.steps - args.warmup) * args.batch_size / elapsed,
        "steps": args.steps,
        "hook": monitor is not None,
        "final_loss": loss,
    }
    if monitor is not None:
        monitor.close()
        stats = monitor.stats
        summary.update(records_sent=stats.records_sent, dropped=stats.dropped)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
