"""A Hugging Face ``Trainer`` with a ``deepspeed`` config (ZeRO-2, DeepSpeed's CPU accelerator,
gloo, world 1, two micro-batches of 4 a step) reporting through ``GpumonTrainerCallback`` to an
in-memory transport; prints the steps it sent as JSON. Run in a process of its own: it
initialises ``torch.distributed``."""

from __future__ import annotations

from tests.client import deepspeed_world1  # noqa: F401  (first: the world, DeepSpeed set up)

# isort: split
import json
import sys
import tempfile
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from gpumon.client.core.transport import MemoryTransport
from gpumon.client.integrations.hf import GpumonTrainerCallback
from gpumon.wire import StepRecord


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        out = self.linear(input_ids).squeeze(-1)
        return {"loss": (out - labels).square().mean(), "logits": out}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randn(16), "labels": torch.randn(())}


def main() -> None:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}
    transport = MemoryTransport()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, max_steps=3, deepspeed=config,
                                 use_cpu=True, report_to=[], logging_steps=100, save_strategy="no")
        trainer = Trainer(model=Regression(), args=args, train_dataset=Data(),
                          callbacks=[GpumonTrainerCallback(run="hf-deepspeed", transport=transport)])
        trainer.train()
    steps = [{"step": r.step, "samples": r.samples, "phases": dict(r.phases_s)}
             for r in transport.records() if isinstance(r, StepRecord)]
    json.dump({"engine": type(trainer.model_wrapped).__name__, "steps": steps}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
