"""``gpumon run``'s hooks in a real PyTorch loop that knows nothing of gpumon: its steps are its
optimizer steps, with their data wait, forward, backward and optimizer phases; a job with a
monitor of its own is not counted twice; a compiled model trains with no graph broken."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpumon.client import StepMonitor
from gpumon.client import monitor as monitor_module
from gpumon.client.autowatch import calls, hooks
from gpumon.client.core.transport import MemoryTransport
from gpumon.wire import StepRecord
from tests.helpers import steps_of

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


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


def test_a_compiled_optimizer_step_breaks_no_graph_gpumon_would_add(transport: MemoryTransport) -> None:
    from torch._dynamo.utils import counters

    def train_compiled() -> tuple[dict[str, int], int]:
        torch._dynamo.reset()
        counters.clear()
        model, optimizer, data = job()
        step = torch.compile(optimizer.step, backend="eager")
        for x, y in data:
            nn.functional.mse_loss(model(x), y).backward()
            step()
            optimizer.zero_grad()
        return dict(counters["graph_break"]), counters["frames"]["total"]

    hooks.take_out()
    breaks, _ = train_compiled()  # torch's optimizer breaks its own graph once
    hooks.install()
    assert train_compiled() == (breaks, pytest.approx(8, abs=1))  # traced through the hooks
    # Inside the compiled step the optimizer hooks return at once, so no step boundary is
    # seen: a compiled optimizer step is not counted (docs/architecture.md, gpumon run).
    assert recorded(transport) == []


def test_a_step_compiled_whole_breaks_no_more_graphs_and_its_backward_is_timed() -> None:
    # In a new process: the compiler is first imported by the job's torch.compile, after the
    # hooks went in (they wait for it).
    def run(*flags: str) -> dict[str, Any]:
        done = subprocess.run([sys.executable, str(HERE / "compiled_train_step.py"), *flags],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
        return result

    plain, hooked = run(), run("--hooks")
    assert hooked["graph_breaks"] == plain["graph_breaks"]  # torch's own, at Tensor.backward()
    # The forward ran inside the compiled function, unseen; the backward it left to Python is
    # timed (before, the compiler compiled the backward's wrapper and broke a graph there).
    assert hooked["phases"] == [["backward", "data", "optimizer"]] * 8


def test_non_strict_export_tracing_passes_the_hooks_untouched(transport: MemoryTransport) -> None:
    model, optimizer, data = job()
    x, _ = next(iter(data))
    torch.export.export(model, (x,), strict=False)
    assert recorded(transport) == [] and (hooks._state.finder is None or not hooks._state.finder.in_step)


def test_uninstalled_the_hooks_leave_torch_as_it_was(transport: MemoryTransport) -> None:
    from torch.nn.modules import module
    from torch.optim import optimizer

    hooks.uninstall()
    assert torch.autograd.backward.__module__ == "torch.autograd"
    assert torch.compile.__code__.co_filename.endswith("torch/__init__.py")
    assert module.Module.__call__ is module.Module._wrapped_call_impl
    assert not optimizer._global_optimizer_post_hooks


@pytest.fixture
def uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    # Other tests may have compiled code in this process; these learn their models as a job
    # that compiles nothing does.
    monkeypatch.setattr(hooks, "torch_compiled", lambda: False)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: DataLoader[Any], steps: int) -> None:
    loss_fn = nn.MSELoss()
    for _, (x, y) in zip(range(steps), data, strict=False):
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def wrapped(cls: type) -> bool:
    return hasattr(cls.__dict__.get("__call__"), "__wrapped__")


def test_once_the_models_are_learnt_only_their_class_call_is_wrapped(
    transport: MemoryTransport, uncompiled: None
) -> None:
    model, optimizer, data = job(batches=12)
    train(model, optimizer, data, hooks.LEARN_STEPS - 1)
    assert wrapped(nn.Module)  # every module call, while the models are learnt
    train(model, optimizer, data, 8)
    assert not wrapped(nn.Module) and nn.Module.__call__ is nn.Module._wrapped_call_impl
    assert wrapped(nn.Sequential)
    assert "__call__" not in nn.Linear.__dict__ and "__call__" not in nn.MSELoss.__dict__
    steps = recorded(transport)
    assert len(steps) == hooks.LEARN_STEPS - 1 + 8
    assert all(set(s.phases_s) == {"data", "forward", "backward", "optimizer"} for s in steps)


def test_taken_out_a_narrowed_wrap_leaves_the_class_as_it_was_and_comes_back_narrowed(
    transport: MemoryTransport, uncompiled: None
) -> None:
    model, optimizer, data = job(batches=12)
    train(model, optimizer, data, hooks.LEARN_STEPS + 1)
    assert wrapped(nn.Sequential)
    hooks.take_out()
    assert "__call__" not in nn.Sequential.__dict__ and nn.Module.__call__ is nn.Module._wrapped_call_impl
    train(model, optimizer, data, 2)  # not watched
    assert hooks.install()
    assert wrapped(nn.Sequential) and not wrapped(nn.Module)
    train(model, optimizer, data, 2)
    assert len(recorded(transport)) == hooks.LEARN_STEPS + 1 + 2


class Outer(nn.Sequential):
    pass


class Inner(Outer):
    pass


def test_a_model_class_and_its_subclass_each_wrap_torchs_call_once(
    transport: MemoryTransport, uncompiled: None
) -> None:
    torch.manual_seed(0)
    a, b = Outer(nn.Linear(16, 1)), Inner(nn.Linear(16, 1))
    optimizer = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for _ in range(hooks.LEARN_STEPS + 2):
        (nn.functional.mse_loss(a(x), y) + nn.functional.mse_loss(b(x), y)).backward()
        optimizer.step()
    # Each reaches Module.__call__ as it is at the call (calls.module_call), never the other's wrapper.
    assert Outer.__dict__["__call__"].__wrapped__ is calls.module_call
    assert Inner.__dict__["__call__"].__wrapped__ is calls.module_call
    hooks.take_out()
    assert "__call__" not in Outer.__dict__ and "__call__" not in Inner.__dict__


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_a_model_first_trained_after_the_wrap_narrowed_is_learnt_then(
    transport: MemoryTransport, uncompiled: None
) -> None:
    model, optimizer, data = job(batches=24)
    train(model, optimizer, data, hooks.LEARN_STEPS + 1)
    assert not wrapped(nn.Module)
    head = Head()
    head_optimizer = torch.optim.SGD(head.parameters(), lr=1e-3)
    train(head, head_optimizer, data, 1)  # its forward unseen: the backward widens the wrap
    assert wrapped(nn.Module)
    train(head, head_optimizer, data, hooks.LEARN_STEPS + 1)
    assert wrapped(Head) and wrapped(nn.Sequential) and not wrapped(nn.Module)
    steps = recorded(transport)
    assert all("forward" in s.phases_s for s in steps[-hooks.LEARN_STEPS:])


def test_the_loss_computed_after_the_forward_counts_as_forward(
    transport: MemoryTransport, uncompiled: None
) -> None:
    model, optimizer, data = job()

    def slow_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return nn.functional.mse_loss(out, y)

    for x, y in data:
        slow_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    steps = recorded(transport)
    assert len(steps) == 8 and all(s.phases_s["forward"] >= 0.01 for s in steps)


def test_a_compiled_model_is_not_compiled_again_when_the_models_are_learnt(
    transport: MemoryTransport,
) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, optimizer, data = job(batches=12)
    compiled = torch.compile(model, backend="eager")
    train(compiled, optimizer, data, 12)
    assert counters["stats"]["unique_graphs"] == 1
    assert len(recorded(transport)) == 12


def test_until_a_model_is_met_every_module_call_stays_wrapped(
    transport: MemoryTransport, uncompiled: None
) -> None:
    weight = torch.randn(16, 1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for _ in range(hooks.LEARN_STEPS + 2):  # no module: nothing to learn
        nn.functional.mse_loss(x @ weight, y).backward()
        optimizer.step()
    assert wrapped(nn.Module)
    model, model_optimizer, data = job(batches=12)
    train(model, model_optimizer, data, hooks.LEARN_STEPS + 1)
    assert wrapped(nn.Sequential) and not wrapped(nn.Module)


def test_a_forked_child_learns_its_own_models(transport: MemoryTransport, uncompiled: None) -> None:
    model, optimizer, data = job(batches=12)
    train(model, optimizer, data, hooks.LEARN_STEPS + 1)
    assert wrapped(nn.Sequential) and not wrapped(nn.Module)
    hooks._after_fork_in_child()  # as os.fork() runs it in the child
    assert wrapped(nn.Module) and "__call__" not in nn.Sequential.__dict__
    assert hooks._state.learning == hooks.LEARN_STEPS


def test_a_narrowed_wrap_lets_torch_fx_record_a_model_as_a_leaf(
    transport: MemoryTransport, uncompiled: None
) -> None:
    """``torch.fx``'s tracer patches ``Module.__call__`` to record submodule calls; a model's
    class wrapped once the wrap narrowed must still reach that patch."""
    import torch.fx

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x))

    class Outer(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x) * 2

    class NetIsLeaf(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, Net) or super().is_leaf_module(m, qualname)

    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=4)
    train(net, optimizer, data, hooks.LEARN_STEPS + 2)
    assert wrapped(Net) and not wrapped(nn.Module)  # narrowed to the model's class
    graph = NetIsLeaf().trace(Outer(Net()))
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["net"]


class Pair:
    """A batch that knows its size until it is told to break (``shape`` then raises)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.broken = False

    @property
    def shape(self) -> torch.Size:
        if self.broken:
            raise RuntimeError("a batch gpumon cannot measure")
        return self.x.shape


class Raising:
    """Stands in for the monitor's extensions: the step's beginning raises."""

    def begin(self) -> None:
        raise RuntimeError("an extension broken by its API")


@pytest.mark.parametrize("where", ["fetch", "forward", "step end"])
def test_an_error_in_gpumons_own_work_stops_the_watch_and_leaves_the_loop_as_it_was(
    transport: MemoryTransport, uncompiled: None, where: str
) -> None:
    """Well into the run (each hook on its common path, in C where the core is), gpumon's own
    work raises at one hook point: the process is no longer watched, the steps before stay
    recorded, and the loop trains exactly as it does with no hooks at all."""
    warm, steps = hooks.LEARN_STEPS + 3, hooks.LEARN_STEPS + 8
    x, y = torch.randn(8 * steps, 16), torch.randn(8 * steps, 1)
    pairs = [Pair(x[i:i + 8], y[i:i + 8]) for i in range(0, len(x), 8)]

    def run() -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses = []
        for i, pair in enumerate(DataLoader(pairs, batch_size=None)):
            if i == warm:
                finder = hooks._state.finder
                if finder is not None and where == "forward":
                    finder.monitor._core.set_extensions(Raising())
                    finder.monitor._core.set_quiet_until(0.0)
                elif finder is not None and where == "step end":
                    finder.on_step_end = Raising().begin
            loss = nn.functional.mse_loss(model(pair.x), pair.y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    hooks.take_out()
    expected = run()  # no hooks
    assert hooks.install()
    if where == "fetch":
        pairs[warm].broken = True
    losses, parameters = run()
    assert losses == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(parameters, expected[1], strict=True))
    assert hooks._state.finder is None and hooks._state.inert
    counted = [s.step for s in steps_of(transport)]
    assert counted == list(range(warm + (where == "step end")))
