"""Training through a framework under ``torch.distributed.run`` (gloo, CPU), for the
distributed tests: Lightning's ``ddp`` strategy, a Hugging Face ``Trainer``, or FSDP's
``fully_shard`` through the plain hook. Each rank writes ``OUT/rank<R>.json`` with what the
tests compare the records against (its gradient bytes, as the model holds them), and its
training thread's clocks over each step's window where collectives run (``window_s``: wall,
CPU time, run delay, steal, slept (device-like work in the HF and FSDP forwards) and the CPU time spent
inside blocking collective calls, for each step)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Clocks:
    """The training thread's clocks over windows: ``begin()`` ... ``end()``."""

    def __init__(self) -> None:
        self.windows: list[list[float]] = []
        self._start: list[float] | None = None
        self.in_calls_s = 0.0  # CPU time inside the collective calls timed (time_calls)
        self.slept_s = 0.0  # device-like work slept through (sleep_in_forward)

    def now(self) -> list[float]:
        with open("/proc/thread-self/schedstat") as f:
            delay = int(f.read().split()[1]) / 1e9
        with open("/proc/stat") as f:
            steal = int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")  # all cores
        return [time.perf_counter(), time.thread_time(), delay, steal, self.slept_s, self.in_calls_s]

    def sleep_in_forward(self, model: Any, seconds: float) -> None:
        """Device-like work at the top of each forward: slept, as a GPU leaves the host
        thread waiting, and counted, so the window's own work is more than its backward.
        Rank 1 sleeps ``SKEW_S`` longer."""
        if int(os.environ.get("RANK", "0")) == 1:
            seconds += SKEW_S

        def sleep(*_: Any) -> None:
            t0 = time.perf_counter()
            time.sleep(seconds)
            self.slept_s += time.perf_counter() - t0

        model.register_forward_pre_hook(sleep)

    def time_calls(self, *names: str) -> None:
        """Count the thread's CPU time inside these ``torch.distributed`` functions."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        for name in names:
            original = getattr(distributed_c10d, name)

            def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                c0 = time.thread_time()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.in_calls_s += time.thread_time() - c0

            setattr(distributed_c10d, name, timed)
            if getattr(dist, name) is original:
                setattr(dist, name, timed)

    def begin(self) -> None:
        self._start = self.now()

    def end(self) -> None:
        if self._start is not None:
            self.windows.append([b - a for a, b in zip(self._start, self.now(), strict=True)])
            self._start = None


SKEW_S = 0.03
CLOCKS = Clocks()


def comm_heavy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])


def lightning(steps: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from gpumon.client.integrations.lightning import GpumonCallback

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = comm_heavy()
            CLOCKS.sleep_in_forward(self.net, 0.0)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            loss: torch.Tensor = self.net(x).square().mean()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    class Window(pl.Callback):  # type: ignore[misc]
        """From the batch's start (before gpumon's step opens) to the optimizer's."""

        def on_train_batch_start(self, *args: Any) -> None:
            CLOCKS.begin()

        def on_before_optimizer_step(self, *args: Any) -> None:
            CLOCKS.end()

    module = Module()
    data = DataLoader(TensorDataset(torch.randn(64, 2048)), batch_size=2)
    callback = GpumonCallback()
    from lightning.pytorch.strategies import DDPStrategy

    # Gradients as views of the buckets: no copies in and out, CPU work gpumon counts as
    # communication and the window's clocks as work.
    trainer = pl.Trainer(strategy=DDPStrategy(gradient_as_bucket_view=True), accelerator="cpu",
                         devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Window(), callback])
    trainer.fit(module, data)
    return {"grad_bytes": _bytes(module.net), "strategy": type(trainer.strategy).__name__}


def hf(steps: int, out: Path) -> dict[str, Any]:
    import transformers

    from gpumon.client.integrations.hf import GpumonTrainerCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=512, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    CLOCKS.sleep_in_forward(model, 0.02)
    ids = torch.randint(0, 512, (128, 32), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, use_cpu=True, ddp_backend="gloo", report_to=[],
        save_strategy="no", logging_steps=1000, disable_tqdm=True, dataloader_num_workers=0,
    )
    class Window(transformers.TrainerCallback):  # type: ignore[misc]
        """From the step's start (before gpumon's) to the optimizer's."""

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            CLOCKS.begin()

        def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            CLOCKS.end()

    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset,
                                   callbacks=[Window(), GpumonTrainerCallback()])
    trainer.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"grad_bytes": sum(p.numel() * p.element_size() for p in trainable),
            "wrapped": type(trainer.model_wrapped).__name__}


def fsdp(steps: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gpumon.client import StepMonitor

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    CLOCKS.sleep_in_forward(model, 0.02)  # before FSDP's own hook: no gather in flight then
    full_bytes = _bytes(model)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    # FSDP's blocking calls do some CPU work inside (copies): communication, timed here.
    CLOCKS.time_calls("all_gather_into_tensor", "reduce_scatter_tensor")
    mon = StepMonitor()
    mon.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(8, 512)
    for _ in range(steps):
        with mon.step(samples=8):
            CLOCKS.begin()  # all-gathers in forward and backward, reduce-scatters in backward
            with mon.phase("forward"):
                loss = model(x).square().mean()
            with mon.phase("backward"):
                loss.backward()
            CLOCKS.end()
            with mon.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    mon.close()
    dist.destroy_process_group()
    return {"grad_bytes": full_bytes}


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("lightning", "hf", "fsdp"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.framework == "lightning":
        summary = lightning(args.steps)
    elif args.framework == "hf":
        summary = hf(args.steps, args.out)
    else:
        summary = fsdp(args.steps)
    # The Trainers leave the process group up; on gloo, a process that exits with it up
    # aborts now and then in its C++ teardown (torch's own, with or without gpumon).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **summary,
                                                           "window_s": CLOCKS.windows}))


if __name__ == "__main__":
    main()
