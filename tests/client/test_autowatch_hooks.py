"""``gpumon run``'s hooks in a real PyTorch loop that knows nothing of gpumon: its steps are its
optimizer steps, with their data wait, forward, backward and optimizer phases; a job with a
monitor of its own is not counted twice; a compiled model trains with no graph broken."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpumon.client import StepMonitor
from gpumon.client import monitor as monitor_module
from gpumon.client.autowatch import hooks
from gpumon.client.transport import MemoryTransport
from gpumon.wire import StepRecord
from tests.helpers import steps_of


@pytest.fixture
def transport(monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryTransport]:
    memory = MemoryTransport()
    # Monitors other tests left for the collector must not look like the job's own.
    monkeypatch.setattr(monitor_module, "_live_monitors", weakref.WeakSet())
    monkeypatch.setattr(hooks, "make_monitor", lambda: StepMonitor(run="auto", transport=memory))
    assert hooks.install()
    yield memory
    hooks.uninstall()


def recorded(transport: MemoryTransport) -> list[StepRecord]:
    finder = hooks._state.finder
    if finder is not None:
        finder.monitor.flush()
    return steps_of(transport)


def job(batches: int = 8) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = DataLoader(TensorDataset(torch.randn(8 * batches, 16), torch.randn(8 * batches, 1)), batch_size=8)
    return model, optimizer, data


def test_a_plain_loop_reports_one_step_per_optimizer_step(transport: MemoryTransport) -> None:
    model, optimizer, data = job()
    for x, y in data:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    steps = recorded(transport)
    assert [s.step for s in steps] == list(range(8))
    for s in steps:
        assert set(s.phases_s) == {"data", "forward", "backward", "optimizer"}
        assert s.samples == 8
        assert sum(s.phases_s.values()) <= s.duration_s
    breakdown = steps[0].memory_breakdown
    assert breakdown is not None and breakdown.optimizer_states > 0  # Adam's states, paired


def test_gradient_accumulation_four_is_one_step_per_four_batches(transport: MemoryTransport) -> None:
    model, optimizer, data = job(batches=12)
    for i, (x, y) in enumerate(data):
        (nn.functional.mse_loss(model(x), y) / 4).backward()
        if i % 4 == 3:
            optimizer.step()
            optimizer.zero_grad()
    steps = recorded(transport)
    assert len(steps) == 3 and all(s.samples == 32 for s in steps)


def test_a_closure_run_by_the_optimizer_is_timed_as_forward_and_backward(transport: MemoryTransport) -> None:
    model, optimizer, data = job(batches=4)
    for x, y in data:
        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
    steps = recorded(transport)
    assert len(steps) == 4
    assert all({"forward", "backward", "optimizer"} <= set(s.phases_s) for s in steps)


def test_a_job_with_its_own_monitor_is_counted_once(transport: MemoryTransport) -> None:
    own = MemoryTransport()
    mon = StepMonitor(run="own", transport=own)
    model, optimizer, data = job()
    for x, y in mon.loader(data):
        with mon.step():
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    mon.close()
    assert len(steps_of(own)) == 8
    assert recorded(transport) == [] and hooks._state.finder is None


def test_a_compiled_model_trains_and_no_graph_is_broken(transport: MemoryTransport) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, optimizer, data = job()
    compiled = torch.compile(model, backend="eager")
    for x, y in data:
        nn.functional.mse_loss(compiled(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert dict(counters["graph_break"]) == {}
    steps = recorded(transport)
    assert len(steps) == 8 and all("forward" in s.phases_s for s in steps)


def test_uninstalled_the_hooks_leave_torch_as_it_was(transport: MemoryTransport) -> None:
    from torch.nn.modules import module
    from torch.optim import optimizer

    hooks.uninstall()
    assert torch.autograd.backward.__module__ == "torch.autograd"
    assert module.Module.__call__ is module.Module._wrapped_call_impl
    assert not optimizer._global_optimizer_post_hooks
