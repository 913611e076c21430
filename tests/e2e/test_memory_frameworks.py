"""Lightning and Hugging Face ``Trainer`` runs export the memory breakdown with no extra user
code: their callbacks watch the model and optimizer themselves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpumon.client.watchers.memory import INTERVAL_ENV
from tests.helpers import AgentProcess, wait_for

pytestmark = pytest.mark.agent("--simulate", "1", "--interval", "0.25")


@pytest.fixture(autouse=True)
def memory_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0")  # every step: the runs last a second or two


def breakdown(agent: AgentProcess, run: str) -> dict[str, float]:
    """The run's exported components (rank 0), once all of the named parts have arrived."""
    def read() -> dict[str, float] | None:
        got = {dict(labels)["component"]: value for (name, labels), value in agent.metrics().items()
               if name == "gpumon_memory_bytes" and ("run", run) in labels}
        return got if {"parameters", "gradients", "optimizer_states", "activations"} <= set(got) \
            else None

    found: dict[str, float] = wait_for(read, timeout=20, what=f"{run}'s memory breakdown")
    return found


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_lightning_exports_the_breakdown(agent: AgentProcess) -> None:
    import lightning.pytorch as pl

    from gpumon.client.integrations.lightning import GpumonCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader[Any]:
            data = TensorDataset(torch.randn(128, 32), torch.randint(0, 4, (128,)))
            return DataLoader(data, batch_size=16)

    module = Module()
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[GpumonCallback(run="lightning-memory",
                                                   socket_path=str(agent.socket_path))])
    trainer.fit(module)
    got = breakdown(agent, "lightning-memory")
    assert got["parameters"] == pytest.approx(param_bytes(module), rel=0.02)
    assert got["gradients"] == pytest.approx(param_bytes(module), rel=0.02)
    assert got["optimizer_states"] == pytest.approx(2 * param_bytes(module), rel=0.02)
    assert got["activations"] > 16 * 256 * 4  # at least the hidden layer of one batch


def test_hf_trainer_exports_the_breakdown(agent: AgentProcess, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from gpumon.client.integrations.hf import GpumonTrainerCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the model is built from a config: no downloads
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256,
                                     n_positions=32)
    model = transformers.GPT2LMHeadModel(config)  # its output embedding is tied to the input's
    ids = torch.randint(0, 256, (64, 32))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True)
    callback = GpumonTrainerCallback(run="hf-memory", socket_path=str(agent.socket_path))
    trainer = transformers.Trainer(model=model, args=args, callbacks=[callback],
                                   train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train()
    got = breakdown(agent, "hf-memory")
    # Tied weights counted once: exactly the model's distinct parameters.
    assert got["parameters"] == pytest.approx(param_bytes(model), rel=0.02)
    assert got["optimizer_states"] == pytest.approx(2 * param_bytes(model), rel=0.02)
    assert got["activations"] > 4 * 32 * 64 * 4  # at least one hidden state of a micro-batch
