"""Training jobs with nothing of gpumon in them, for ``gpumon run``'s distributed tests (CPU,
gloo). Each rank writes ``OUT/rank<R>.json`` with what it counted itself: its optimizer steps
and micro-batches, and for ``ddp`` its training thread's clocks over each step's backward.

* ``ddp`` (under ``torch.distributed.run``): the communication-heavy model of ``ddp_job.py``
  (gradients as views of DDP's buckets); for every step, the training thread's wall time, CPU
  time, run delay and the steal over its backward, where DDP's all-reduce runs, then a barrier
  that re-aligns the ranks.
* ``lightning`` (started as a plain script; Lightning's ``ddp`` strategy starts the second rank):
  the same model, four micro-batches per optimizer step.
* ``hf`` (under ``torch.distributed.run``): a small GPT-2 in a ``Trainer``, four micro-batches
  per optimizer step.
* ``deepspeed`` (under the ``deepspeed`` launcher, ``DS_ACCELERATOR=cpu``): a small MLP in a
  ZeRO-1 engine, four micro-batches per optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


def comm_heavy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])


def ddp(steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(comm_heavy(), gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    generator = torch.Generator().manual_seed(rank)
    backward_s: list[list[float]] = []

    for _ in range(warmup + steps):
        x = torch.randn(2, 2048, generator=generator)
        loss = model(x).square().mean()
        before = _clocks()
        loss.backward()
        backward_s.append([b - a for a, b in zip(before, _clocks(), strict=True)])
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
    dist.destroy_process_group()
    return {"optimizer_steps": warmup + steps, "backward_s": backward_s,
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def _clocks() -> list[float]:
    """Wall, the thread's CPU time, its run delay, the steal from all cores, slept (none)."""
    with open("/proc/thread-self/schedstat") as f:
        delay = int(f.read().split()[1]) / 1e9
    with open("/proc/stat") as f:
        steal = int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    return [time.perf_counter(), time.thread_time(), delay, steal, 0.0]


def lightning(steps: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = comm_heavy()
            self.micro_batches = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.micro_batches += 1
            (x,) = batch
            loss: torch.Tensor = self.net(x).square().mean()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    module = Module()
    data = DataLoader(TensorDataset(torch.randn(256, 2048)), batch_size=2)
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=4)
    trainer.fit(module, data)
    return {"rank": trainer.global_rank, "optimizer_steps": trainer.global_step,
            "micro_batches": module.micro_batches,
            "strategy": type(trainer.strategy).__name__}


def hf(steps: int, out: Path) -> dict[str, Any]:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=512, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    forwards = [0]
    model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    ids = torch.randint(0, 512, (256, 32), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=4, use_cpu=True, ddp_backend="gloo", report_to=[],
        save_strategy="no", logging_steps=1000, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    return {"optimizer_steps": trainer.state.global_step, "micro_batches": forwards[0],
            "wrapped": type(trainer.model_wrapped).__name__}


def deepspeed_job(steps: int) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    # The CPU accelerator compiles a shared-memory all-reduce op at init_distributed for
    # inference alone (minutes on two cores, and a lock a killed build leaves behind): off.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    stepped = [0]
    optimizer.register_step_post_hook(lambda *_: stepped.__setitem__(0, stepped[0] + 1))
    generator = torch.Generator().manual_seed(dist.get_rank())
    micro_batches = 0
    while engine.global_steps < steps:
        loss = engine(torch.randn(4, 256, generator=generator)).square().mean()
        engine.backward(loss)
        engine.step()
        micro_batches += 1
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"rank": rank, "optimizer_steps": engine.global_steps, "inner_steps": stepped[0],
            "micro_batches": micro_batches}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("ddp", "lightning", "hf", "deepspeed"))
    parser.add_argument("--local_rank", type=int, default=None, help="given by the deepspeed launcher")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.framework == "ddp":
        summary = ddp(args.steps, args.warmup)
    elif args.framework == "lightning":
        summary = lightning(args.steps)
    elif args.framework == "deepspeed":
        summary = deepspeed_job(args.steps)
    else:
        summary = hf(args.steps, args.out)
    # The Trainers leave the process group up; on gloo, a process that exits with it up
    # aborts now and then in its C++ teardown (torch's own, with or without gpumon).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    rank = summary.pop("rank", None)
    rank = int(os.environ["RANK"]) if rank is None else rank
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **summary}))


if __name__ == "__main__":
    main()
