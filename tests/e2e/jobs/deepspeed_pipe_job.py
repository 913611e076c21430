"""A DeepSpeed pipeline-parallel job on CPU (gloo, ``DS_ACCELERATOR=cpu``): a ``PipelineModule``
of ``LayerSpec``s in 2 stages trained with ``engine.train_batch()``, a torch optimizer, 4
micro-batches a batch; launched by ``torch.distributed.run`` and unchanged (no gpumon import),
so that it runs under ``gpumon run``, or with ``--hooked`` ``mon.watch(engine)`` and nothing
else. Stage 1 does device-like work (a sleep of ``--work-ms`` in
each micro-batch's forward, twice that in its backward), stage 0 a tenth of it.

Each rank writes to ``OUT/rank<R>.json`` its own timing of each ``train_batch`` and the sleeps
its stage did (``own``), and DeepSpeed's own view of its place: its pipeline stage and data-
parallel rank from the engine's grid.

    deepspeed_pipe_job.py --out OUT [--steps N] [--work-ms 10] [--hooked]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from time import perf_counter

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

WIDTH = 64
MICRO = 4
_slept = [0.0]


class Work(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        _sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        _sleep(2 * ctx.seconds)
        return grad, None


def _sleep(seconds: float) -> None:
    start = perf_counter()
    time.sleep(seconds)
    _slept[0] += perf_counter() - start


class Layer(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Work.apply(torch.tanh(self.linear(x)), self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--work-ms", type=float, default=10.0)
    parser.add_argument("--hooked", action="store_true",
                        help="watch the engine with a StepMonitor of its own (mon.watch(engine))")
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    heavy = args.work_ms / 1000
    layers = [LayerSpec(Layer, heavy / 10), LayerSpec(Layer, heavy)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(),
                           partition_method="uniform")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = {"train_batch_size": 8 * MICRO, "train_micro_batch_size_per_gpu": 8,
              "gradient_accumulation_steps": MICRO, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if args.hooked:
        from gpumon.client import StepMonitor

        StepMonitor().watch(engine)
    torch.manual_seed(0)
    batches = [(torch.randn(8, WIDTH), torch.randn(8, WIDTH)) for _ in range(MICRO)]
    steps = []
    for _ in range(args.steps):
        _slept[0] = 0.0
        start = perf_counter()
        engine.train_batch(data_iter=iter(batches))
        duration = perf_counter() - start
        steps.append({"duration": duration, "own": _slept[0], "bubble": duration - _slept[0]})
    rank = torch.distributed.get_rank()
    grid = engine.grid
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "pid": os.getpid(), "steps": steps,
         "stage": grid.get_pipe_parallel_rank(), "dp": grid.get_data_parallel_rank()}))


if __name__ == "__main__":
    main()
