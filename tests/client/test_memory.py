"""A real CPU training job through the public hook, watched: the memory breakdown in its step
records against what the job measures itself, independently of gpumon."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpumon.client import StepMonitor
from gpumon.client.core.transport import MemoryTransport
from gpumon.client.watchers.memory import INTERVAL_ENV, MemoryBreakdownSampler
from gpumon.wire import MemoryBreakdown, StepRecord


def saved_by_autograd(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd keeps for backward in one forward, measured by the test itself: distinct
    saved tensors (by data pointer), parameters left out."""
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def run_job(batch: int, steps: int) -> tuple[list[MemoryBreakdown], dict[str, int], list[float]]:
    """An MLP with Adam (fp32) for ``steps`` steps of ``batch`` samples; returns the sampled
    breakdowns, the bytes the job counts from its own tensors, and its losses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(batch * steps, 64), torch.randint(0, 8, (batch * steps,)))
    transport = MemoryTransport()
    mon = StepMonitor(run="mlp", transport=transport, rank=0, world=1)
    model = mon.watch(model, opt)
    assert mon.watch(model, opt) is model  # idempotent: still one sampler, one breakdown
    losses = []
    for x, y in mon.loader(DataLoader(data, batch_size=batch)):
        with mon.step(samples=len(x)):
            with mon.phase("forward"):
                loss = nn.functional.cross_entropy(model(x), y)
            with mon.phase("backward"):
                loss.backward()
            with mon.phase("optimizer"):
                opt.step()
                opt.zero_grad()
        losses.append(loss.item())
    mon.close()
    truth = {
        "parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
        "optimizer_states": sum(v.numel() * v.element_size() for s in opt.state.values()
                                for v in s.values() if torch.is_tensor(v)),
        "activations": saved_by_autograd(model, x, y),
    }
    truth["gradients"] = truth["parameters"]  # one gradient per parameter, same dtype
    steps_seen = [r for r in transport.records() if isinstance(r, StepRecord)]
    assert len(steps_seen) == steps
    return [r.memory_breakdown for r in steps_seen if r.memory_breakdown], truth, losses


def test_mlp_with_adam_through_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0")  # every step, so that the test need not wait 5 s
    small, truth, _ = run_job(batch=64, steps=4)
    assert len(small) == 4
    last = small[-1]
    for part in ("parameters", "gradients", "optimizer_states"):
        assert getattr(last, part) == pytest.approx(truth[part], rel=0.02), part
    assert last.activations == pytest.approx(truth["activations"], rel=0.25)
    assert small[0].optimizer_states == last.optimizer_states  # the states exist after step 0

    big, big_truth, _ = run_job(batch=128, steps=4)
    assert big[-1].activations == pytest.approx(big_truth["activations"], rel=0.25)
    assert big[-1].activations is not None and last.activations is not None
    assert 1.6 <= big[-1].activations / last.activations <= 2.4
    for part in ("parameters", "gradients", "optimizer_states"):
        assert getattr(big[-1], part) == getattr(last, part), part


def test_watching_changes_nothing_in_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0")
    _, _, watched = run_job(batch=32, steps=5)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(32 * 5, 64), torch.randint(0, 8, (32 * 5,)))
    plain = []
    for x, y in DataLoader(data, batch_size=32):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain.append(loss.item())
    assert watched == plain  # bit for bit


def test_default_interval_samples_the_first_step_only_in_a_short_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    breakdowns, _, _ = run_job(batch=16, steps=6)
    assert len(breakdowns) == 1


def test_a_bad_interval_falls_back_to_the_default(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    breakdowns, _, _ = run_job(batch=16, steps=3)
    assert len(breakdowns) == 1
    assert INTERVAL_ENV in caplog.text


def test_watch_on_anything_else_is_harmless_and_an_optimizer_given_later_is_added(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0")
    transport = MemoryTransport()
    mon = StepMonitor(run="w", transport=transport, rank=0, world=1)
    thing = object()
    assert mon.watch(thing) is thing  # not a module: nothing registered
    assert mon.extensions.get(MemoryBreakdownSampler) is None
    model = nn.Linear(8, 8)
    mon.watch(model)  # no optimizer yet (a framework hands it over later)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for with_optimizer in (False, True):
        if with_optimizer:
            mon.watch(model, opt)
        with mon.step():
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    mon.close()
    first, second = [r.memory_breakdown for r in transport.records()
                     if isinstance(r, StepRecord) and r.memory_breakdown]
    assert first.optimizer_states is None
    assert second.optimizer_states == (8 * 8 + 8) * 4  # the momentum buffers
    assert mon.stats.extension_errors == 0
