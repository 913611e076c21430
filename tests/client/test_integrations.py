"""Real training loops reporting through a real socket: the CPU example, Lightning, transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.client.conftest import Receiver

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_cpu.py"


def run_example(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    summary: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return summary


def test_cpu_example_reports_every_step(receiver: Receiver) -> None:
    summary = run_example(
        "--steps", "30", "--warmup", "2", "--batch-size", "32", "--workers", "2",
        env={"GPUMON_SOCKET": str(receiver.path), "GPUMON_RUN": "cpu-example"},
    )  # fmt: skip
    steps = receiver.wait_for_steps(30)
    assert [s.step for s in steps] == list(range(30))
    assert summary["records_sent"] == 32 and summary["dropped"] == {}  # the hello, the finish
    assert summary["samples_per_second"] > 0
    for s in steps:
        assert s.run == "cpu-example" and s.samples == 32
        assert s.flops is not None and s.flops > 0
        assert {"data", "forward", "backward", "optimizer"} <= set(s.phases_s)
    # DataLoader workers are forked from the training process: none of them reported.
    assert {s.pid for s in steps} == {receiver.hellos()[0].pid}
    assert len(receiver.hellos()) == 1


def test_cpu_example_input_bound_shows_as_data_wait(receiver: Receiver) -> None:
    run_example(
        "--steps", "6", "--warmup", "1", "--batch-size", "32", "--input-bound",
        "--run", "slow-input", "--socket", str(receiver.path),
    )  # fmt: skip
    steps = receiver.wait_for_steps(6)
    assert len(steps) == 6
    data_fraction = sum(s.phases_s["data"] for s in steps) / sum(s.duration_s for s in steps)
    assert data_fraction > 0.5  # 32 samples x 0.5 ms of loading against a tiny MLP


def test_cpu_example_without_hook_sends_nothing(receiver: Receiver) -> None:
    summary = run_example("--steps", "10", "--warmup", "1", "--no-hook", "--socket", str(receiver.path))
    assert summary["hook"] is False and summary["samples_per_second"] > 0
    assert receiver.records == []


class TinyModule:
    """Builds a LightningModule lazily so this file imports without Lightning."""

    @staticmethod
    def make() -> Any:
        import lightning.pytorch as pl

        class Tiny(pl.LightningModule):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.layer = nn.Linear(16, 4)

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                x, y = batch
                return nn.functional.cross_entropy(self.layer(x), y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def train_dataloader(self) -> DataLoader[Any]:
                data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
                return DataLoader(data, batch_size=8)

        return Tiny()


def test_lightning_callback_reports_each_batch(receiver: Receiver) -> None:
    import lightning.pytorch as pl  # installed by scripts/setup: missing is a failure

    from gpumon.client.integrations.lightning import GpumonCallback

    callback = GpumonCallback(
        run="lightning", socket_path=str(receiver.path), tokens=lambda batch: batch[0].numel()
    )
    trainer = pl.Trainer(
        max_steps=5,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(TinyModule.make())
    steps = receiver.wait_for_steps(5)
    assert [s.step for s in steps] == [0, 1, 2, 3, 4]
    for s in steps:
        assert (s.run, s.rank, s.world, s.samples, s.tokens) == ("lightning", 0, 1, 8, 8 * 16)
        assert {"data", "forward", "backward", "optimizer"} <= set(s.phases_s)
    assert callback.monitor is None  # closed at teardown


def test_lightning_callback_reports_oom_and_lets_it_propagate(receiver: Receiver) -> None:
    import lightning.pytorch as pl  # installed by scripts/setup: missing is a failure

    from gpumon.client.integrations.lightning import GpumonCallback

    module = TinyModule.make()
    calls = {"n": 0}
    original = module.training_step

    def failing_step(batch: Any, batch_idx: int) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        result: torch.Tensor = original(batch, batch_idx)
        return result

    module.training_step = failing_step
    trainer = pl.Trainer(
        max_steps=5,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[GpumonCallback(run="lightning-oom", socket_path=str(receiver.path))],
    )
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 1.00 GiB"):
        trainer.fit(module)
    assert len(receiver.wait_for_steps(2)) == 2
    [event] = [e for e in receiver.events() if e.event == "oom"]
    assert event.step == 2 and event.message is not None and "1.00 GiB" in event.message


def test_hf_trainer_callback_reports_optimizer_steps(
    receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import accelerate  # noqa: F401  (the Trainer needs it; installed by scripts/setup)
    import transformers

    from gpumon.client.integrations.hf import GpumonTrainerCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the model is built from a config: no downloads
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (64, 16))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    callback = GpumonTrainerCallback(run="hf", socket_path=str(receiver.path))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])
    trainer.train()
    steps = receiver.wait_for_steps(4)
    assert [s.step for s in steps] == [0, 1, 2, 3]
    params = model.num_parameters(exclude_embeddings=True)
    for s in steps:
        assert (s.run, s.samples, s.tokens) == ("hf", 8, 8 * 16)  # 2 micro-batches of 4 x 16
        assert s.flops == pytest.approx(6 * params * 8 * 16)
        assert {"forward", "backward", "optimizer"} <= set(s.phases_s)
    assert sum(s.phases_s.get("data", 0.0) for s in steps) > 0
