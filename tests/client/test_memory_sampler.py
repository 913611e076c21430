"""The memory-breakdown sampler on real torch models (CPU), against bytes the tests count from
the tensors themselves."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gpumon.client.watchers.memory import MemoryBreakdownSampler


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def saved_for_backward(model: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """What autograd saves for backward in ``run()``, measured independently of gpumon:
    distinct tensors (by data pointer) that are not parameters."""
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def sampled_step(sampler: MemoryBreakdownSampler, step: Callable[[], None]) -> dict[str, int]:
    fields: dict[str, object] = {}
    sampler.step_begin()
    step()
    sampler.step_end(fields)
    memb = fields.get("memb")
    assert isinstance(memb, dict), fields
    return memb


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: int) -> Callable[[], None]:
    def step() -> None:
        x, y = torch.randn(batch, 128), torch.randint(0, 10, (batch,))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()  # after the step, as most loops do: the sampler still sees gradients
    return step


def test_mlp_adam_fp32_matches_the_tensors() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    sampler = MemoryBreakdownSampler(model, opt, interval_s=0.0)
    small = sampled_step(sampler, train_step(model, opt, 64))
    small = sampled_step(sampler, train_step(model, opt, 64))  # states exist from step 1 on
    params = list(model.parameters())
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    assert small["parameters"] == pytest.approx(_bytes(params), rel=0.02)
    assert small["gradients"] == pytest.approx(_bytes(params), rel=0.02)
    assert small["optimizer_states"] == pytest.approx(_bytes(states), rel=0.02)
    assert small["optimizer_states"] == pytest.approx(2 * _bytes(params), rel=0.02)

    def forward(batch: int) -> Callable[[], torch.Tensor]:
        return lambda: nn.functional.cross_entropy(model(torch.randn(batch, 128)),
                                                   torch.randint(0, 10, (batch,)))

    truth = saved_for_backward(model, forward(64))
    assert small["activations"] == pytest.approx(truth, rel=0.25)

    big = sampled_step(sampler, train_step(model, opt, 128))
    assert 1.6 <= big["activations"] / small["activations"] <= 2.4
    for part in ("parameters", "gradients", "optimizer_states"):
        assert big[part] == small[part], part
    assert big["activations"] == pytest.approx(saved_for_backward(model, forward(128)), rel=0.25)


def test_tied_and_shared_weights_count_once() -> None:
    emb = nn.Embedding(1000, 64)
    head = nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight  # tied, as language models tie input and output embeddings
    model = nn.Sequential(emb, nn.Flatten(), nn.Unflatten(1, (8, 64)), head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = MemoryBreakdownSampler(model, opt, interval_s=0.0)

    def step() -> None:
        model(torch.randint(0, 1000, (4, 8))).sum().backward()
        opt.step()

    memb = sampled_step(sampler, step)
    assert memb["parameters"] == 1000 * 64 * 4
    assert memb["gradients"] == 1000 * 64 * 4
    assert memb["optimizer_states"] == 1000 * 64 * 4  # one momentum buffer


def test_bf16_model_with_fp32_master_copy_counts_masters_as_optimizer_states() -> None:
    model = mlp().to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.Adam(masters)
    sampler = MemoryBreakdownSampler(model, opt, interval_s=0.0)

    def step() -> None:
        x = torch.randn(32, 128, dtype=torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        for master, p in zip(masters, model.parameters(), strict=True):
            master.grad = p.grad.float()  # type: ignore[union-attr]
        opt.step()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters(), strict=True):
                p.copy_(master)
        model.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)

    memb = sampled_step(sampler, step)
    n = sum(p.numel() for p in model.parameters())
    assert memb["parameters"] == 2 * n
    # fp32 master copy (4) + Adam m and v (8): the ZeRO paper's K = 12, plus Adam's step counters
    assert memb["optimizer_states"] == pytest.approx(12 * n, rel=0.01)
    # bf16 gradients, read when backward ends (the fp32 copies made after it are transient)
    assert memb["gradients"] == 2 * n


def test_autocast_weight_copies_are_parameters_not_activations() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = MemoryBreakdownSampler(model, opt, interval_s=0.0)
    x = torch.randn(64, 128)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    memb = sampled_step(sampler, step)
    n = sum(p.numel() for p in model.parameters())
    # The fp32 parameters plus the bf16 casts of the weights autograd saved for backward: the
    # second and third layers' (the first one's is not needed, its input wants no gradient).
    weights = model[2].weight.numel() + model[4].weight.numel()
    assert memb["parameters"] == 4 * n + 2 * weights
    with torch.autocast("cpu", dtype=torch.bfloat16):
        truth = saved_for_backward(model, lambda: model(x).float().pow(2).mean())
    assert memb["activations"] < truth  # the test's count includes the weight casts
    assert memb["activations"] == pytest.approx(truth - 2 * weights, rel=0.25)


def test_samples_once_per_interval_and_unsampled_steps_add_nothing() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    now = [0.0]
    sampler = MemoryBreakdownSampler(model, opt, interval_s=5.0, clock=lambda: now[0])
    sampled = []
    for _ in range(12):
        fields: dict[str, object] = {}
        sampler.step_begin()
        train_step(model, opt, 8)()
        sampler.step_end(fields)
        sampled.append("memb" in fields)
        now[0] += 1.0
    assert [i for i, s in enumerate(sampled) if s] == [0, 5, 10]
    assert sampler.samples == 3


def test_a_forward_without_backward_stops_activation_sampling() -> None:
    model = mlp()
    sampler = MemoryBreakdownSampler(model, None, interval_s=0.0)
    memb = sampled_step(sampler, lambda: None if model(torch.randn(4, 128)) is None else None)
    assert memb["activations"] > 0  # alive at the step's end: nothing freed them
    assert "optimizer_states" not in memb
    memb = sampled_step(sampler, lambda: model(torch.randn(4, 128)).sum().backward())
    assert "activations" not in memb and memb["gradients"] > 0


def test_cpu_other_is_saved_activations_kept_alive_across_steps() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = MemoryBreakdownSampler(model, opt, interval_s=0.0)
    kept: list[torch.Tensor] = []

    def leaky() -> None:
        hidden = model[:2](torch.randn(64, 128))
        kept.append(hidden)  # the leak: every step's hidden activations stay alive
        nn.functional.cross_entropy(model[2:](hidden), torch.randint(0, 10, (64,))).backward()
        opt.step()
        opt.zero_grad()

    others = [sampled_step(sampler, leaky).get("other") for _ in range(4)]
    assert others[0] is None  # nothing sampled before: nothing to find alive
    hidden_bytes = 64 * 256 * 4
    assert others[1:] == [hidden_bytes, 2 * hidden_bytes, 3 * hidden_bytes]

    clean = MemoryBreakdownSampler(model, opt, interval_s=0.0)
    others = [sampled_step(clean, train_step(model, opt, 64)).get("other") for _ in range(3)]
    assert others == [None, 0, 0]


def test_a_model_gone_stops_sampling_quietly() -> None:
    model = mlp()
    sampler = MemoryBreakdownSampler(model, None, interval_s=0.0)
    del model
    fields: dict[str, object] = {}
    sampler.step_begin()
    sampler.step_end(fields)
    assert fields == {}


def test_weights_swapped_in_for_the_registered_ones_are_parameters() -> None:
    """FSDP keeps a shard registered and runs forward on all-gathered weights it swaps in:
    saved for backward, those are parameters too, not activations."""

    class Swapping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Parameter(torch.randn(128, 128))
            self.full = nn.Parameter(torch.randn(128, 128))  # gathered for the forward

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ self.first) @ self.full

    model = Swapping()
    full = model.full
    del model._parameters["full"]  # no longer registered, as FSDP's unsharded weights are not
    object.__setattr__(model, "full", full)
    sampler = MemoryBreakdownSampler(model, None, interval_s=0.0)
    x = torch.randn(16, 128, requires_grad=False)
    memb = sampled_step(sampler, lambda: model(x).sum().backward())
    assert memb["parameters"] == 2 * 128 * 128 * 4
    assert memb["activations"] == 2 * 16 * 128 * 4  # x and the relu output, not the weight


def test_between_samples_a_monitor_makes_no_call_to_the_sampler() -> None:
    from gpumon.client import StepMonitor
    from gpumon.client.core.transport import MemoryTransport
    from gpumon.client.watchers.memory import watch_memory
    from tests.helpers import steps_of

    transport = MemoryTransport()
    mon = StepMonitor(run="quiet", transport=transport, rank=0, world=1)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = watch_memory(mon, model, optimizer)
    sampler._interval_s = 0.2
    calls = {"begin": 0, "end": 0}
    begin, end = sampler.step_begin, sampler.step_end

    def counted_begin() -> None:
        calls["begin"] += 1
        begin()

    def counted_end(fields: dict[str, object]) -> None:
        calls["end"] += 1
        end(fields)

    sampler.step_begin, sampler.step_end = counted_begin, counted_end  # type: ignore[method-assign]
    t_end = time.perf_counter() + 0.5
    steps = 0
    while time.perf_counter() < t_end:
        with mon.step():
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        steps += 1
        time.sleep(0.001)
    mon.flush()
    sampled = [s for s in steps_of(transport) if s.memory_breakdown is not None]
    assert 2 <= len(sampled) <= 4  # at 0 s, then about every 0.2 s
    assert calls["begin"] == calls["end"] == len(sampled) < steps / 10
    mon.close()
