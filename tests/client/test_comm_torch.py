"""Measuring real torch.distributed collectives and DDP buckets, in-process (gloo, world size 1).

A world of one runs the same code paths (the wrapped functions, DDP's reducer and comm hook,
the autograd engine's callbacks) without peers; multi-rank jobs are in tests/e2e.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gpumon.client import StepMonitor
from gpumon.client.comm import tap as comm_tap
from gpumon.client.comm.ledger import CommLedger
from gpumon.client.core.comm_inflight import IN_FLIGHT
from gpumon.client.core.transport import MemoryTransport
from gpumon.client.watchers.ddp import FOLLOWED, HOOKED, INFERRED, NOT_MEASURED, watch_ddp
from gpumon.client.watchers.ddp_buckets import Buckets
from gpumon.client.watchers.watch import find_wrapper, kind_of
from gpumon.wire import StepRecord

pytestmark = pytest.mark.usefixtures("world_of_one")


def _step(ledger: CommLedger, body: Any) -> dict[str, Any]:
    fields: dict[str, object] = {}
    ledger.step_begin()
    body()
    ledger.step_end(fields)
    comm_field = fields.get("comm")
    assert comm_field is None or isinstance(comm_field, dict)
    return comm_field or {}


def test_blocking_and_async_collectives_are_counted_with_their_payload(ledger: CommLedger) -> None:
    tensor = torch.ones(1000)  # 4,000 bytes
    gathered = [torch.zeros(10)]

    def body() -> None:
        dist.all_reduce(tensor)
        work = dist.all_reduce(tensor, async_op=True)
        assert work is not None
        work.wait()
        dist.all_gather(gathered, torch.ones(10))
        dist.broadcast(tensor, src=0)
        dist.barrier()

    stats = _step(ledger, body)
    assert stats["ops"]["all_reduce"][:2] == [2, 8000]
    assert stats["ops"]["all_gather"][:2] == [1, 40]
    assert stats["ops"]["broadcast"][:2] == [1, 4000]
    assert stats["ops"]["barrier"][:2] == [1, 0]
    assert all(seconds >= 0 for _, _, seconds in stats["ops"].values())
    assert 0 < stats["exposed"] <= stats["busy"]


def test_the_wrapped_functions_return_what_torch_returns(ledger: CommLedger) -> None:
    tensor = torch.arange(4.0)
    assert dist.all_reduce(tensor) is None
    work = dist.all_reduce(tensor, async_op=True)
    assert isinstance(work, dist.Work)
    work.wait()
    assert torch.equal(tensor, torch.arange(4.0))  # a world of one: the sum is itself
    assert dist.all_reduce.__name__ == "all_reduce"
    assert "Reduces the tensor" in (dist.all_reduce.__doc__ or "")


def test_without_a_watching_ledger_nothing_is_recorded() -> None:
    led = CommLedger()
    led.step_begin()
    dist.all_reduce(torch.ones(4))
    fields: dict[str, object] = {}
    led.step_end(fields)
    assert fields["comm"] == {"exposed": 0.0, "busy": 0.0, "ops": {}}
    assert comm_tap._ledgers == []


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _train_step(ddp: nn.Module) -> None:
    ddp(torch.randn(4, 64, generator=torch.Generator().manual_seed(1))).sum().backward()


def _grad_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_ddp_buckets_on_the_host_are_followed_without_a_comm_hook(ledger: CommLedger) -> None:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]), bucket_cap_mb=0.5)
    assert watch_ddp(ledger, ddp) == FOLLOWED
    assert watch_ddp(ledger, ddp) == FOLLOWED  # again: nothing changes
    # DDP runs its own all-reduce, scaling as it copies: no hook of any kind is registered.
    assert not ddp._get_ddp_logging_data().get("comm_hook") and not ddp._comm_hooks

    def train() -> None:
        ddp(torch.randn(4, 256)).sum().backward()

    for buckets in (1, 3, 3):  # DDP sizes its buckets after the first step
        launched = IN_FLIGHT.launched
        stats = _step(ledger, train)
        assert stats["ops"]["all_reduce"][:2] == [buckets, _grad_bytes(ddp)]
        assert IN_FLIGHT.launched == launched + buckets  # each bucket, for the stall watch
        assert IN_FLIGHT.oldest() is None  # and none left open once backward returned
    assert 0 < stats["exposed"] <= stats["busy"]

    def no_sync() -> None:
        with ddp.no_sync():
            train()

    skipped = _step(ledger, no_sync)
    assert skipped == {"exposed": 0.0, "busy": 0.0, "ops": {}}


def test_ddp_gradients_are_the_same_watched_or_not(ledger: CommLedger) -> None:
    plain, watched = DDP(_model()), DDP(_model())
    watch_ddp(ledger, watched)
    _train_step(plain)
    _step(ledger, lambda: _train_step(watched))
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_a_hook_registered_after_watch_runs_with_its_state_and_is_measured(ledger: CommLedger) -> None:
    ddp = DDP(_model())
    watch_ddp(ledger, ddp)
    calls: list[Any] = []

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        calls.append(state)
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook("my-state", counting_hook)
    stats = _step(ledger, lambda: _train_step(ddp))
    assert calls == ["my-state"]
    assert stats["ops"]["all_reduce"][:2] == [1, _grad_bytes(ddp)]
    assert ddp._get_ddp_logging_data()["comm_hook"].endswith("counting_hook")
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook(None, counting_hook)  # as DDP itself says
    watched = DDP(_model())
    watch_ddp(ledger, watched)

    def wrong(state: Any, bucket: int) -> Any:
        return None

    with pytest.raises(ValueError, match="bucket annotation"):  # the same checks when watched
        watched.register_comm_hook(None, wrong)


def test_a_builtin_hook_registered_after_watch_runs_as_its_python_twin(ledger: CommLedger) -> None:
    ddp, reference = DDP(_model()), DDP(_model())
    watch_ddp(ledger, ddp)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    reference._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    stats = _step(ledger, lambda: _train_step(ddp))
    _train_step(reference)
    assert stats["ops"]["all_reduce"][:2] == [1, _grad_bytes(ddp) // 2]  # what fp16 sends
    for a, b in zip(reference.parameters(), ddp.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_a_python_hook_registered_before_watch_is_measured_by_its_collectives(
    ledger: CommLedger, caplog: pytest.LogCaptureFixture
) -> None:
    ddp = DDP(_model())
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with caplog.at_level(logging.WARNING, logger="gpumon.client"):
        assert watch_ddp(ledger, ddp) == INFERRED
    assert "registered before watch()" in caplog.text
    stats = _step(ledger, lambda: _train_step(ddp))
    assert stats["ops"]["all_reduce"][:2] == [1, _grad_bytes(ddp) // 2]
    assert stats["exposed"] > 0


def test_a_builtin_hook_registered_before_watch_is_not_measured(
    ledger: CommLedger, caplog: pytest.LogCaptureFixture
) -> None:
    ddp = DDP(_model())
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    with caplog.at_level(logging.WARNING, logger="gpumon.client"):
        assert watch_ddp(ledger, ddp) == NOT_MEASURED
    assert "built-in comm hook" in caplog.text
    fields: dict[str, object] = {}
    ledger.step_begin()
    _train_step(ddp)
    ledger.step_end(fields)
    assert "comm" not in fields  # absent, not a zero that was never measured


def test_a_ddp_without_the_expected_internals_is_not_measured(ledger: CommLedger) -> None:
    class OldDdp:  # stands in for a torch whose DDP lacks what the watcher uses
        process_group = None

    assert watch_ddp(ledger, OldDdp()) == NOT_MEASURED


def test_a_watched_ddp_reports_comm_on_every_step_record() -> None:
    transport = MemoryTransport()
    mon = StepMonitor("comm-test", transport=transport, rank=0, world=1)
    ddp = DDP(_model())
    assert mon.watch(ddp) is ddp
    assert mon.watch(ddp) is ddp  # idempotent
    assert mon.watch(nn.Linear(2, 2)) is not None  # a plain module: nothing to do, no error
    for _ in range(3):
        with mon.step():
            with mon.phase("forward"):
                loss = ddp(torch.randn(4, 64)).sum()
            with mon.phase("backward"):
                loss.backward()
    with mon.step():  # no collective in this step: a measured zero
        pass
    mon.close()
    steps = [r for r in transport.records() if isinstance(r, StepRecord)]
    assert len(steps) == 4
    for record in steps[:3]:
        assert record.comm is not None
        (op,) = record.comm.ops
        assert (op.name, op.count, op.bytes) == ("all_reduce", 1, _grad_bytes(ddp))
        # Within the step, up to the µs the ledger's clock reads lie outside the record's.
        assert 0 < record.comm.exposed_s <= record.comm.busy_s <= record.duration_s + 50e-6
        assert record.comm.exposed_s <= record.phases_s["backward"]
    assert steps[3].comm is not None and steps[3].comm.ops == () and steps[3].comm.busy_s == 0.0
    assert mon.stats.extension_errors == 0


def test_the_wrapper_of_a_bare_model_is_found() -> None:
    model = _model()
    ddp = DDP(model)
    assert find_wrapper(model) is ddp  # what the Hugging Face callback watches
    assert find_wrapper(_model()) is None
    assert kind_of(ddp) == "ddp" and kind_of(model) is None and kind_of(object()) is None


def test_where_buckets_cannot_be_followed_the_comm_hook_measures_them(
    ledger: CommLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path a GPU takes (and a torch without post-accumulate hooks): a timing comm hook
    that averages each bucket as DDP does, the same bits."""
    monkeypatch.setattr(Buckets, "follow", classmethod(lambda cls, *args: None))
    plain, watched = DDP(_model()), DDP(_model())
    assert watch_ddp(ledger, watched) == HOOKED
    assert watched._get_ddp_logging_data().get("comm_hook")  # the timing hook is DDP's hook
    _train_step(plain)
    stats = _step(ledger, lambda: _train_step(watched))
    assert stats["ops"]["all_reduce"][:2] == [1, _grad_bytes(watched)]
    assert 0 < stats["exposed"] <= stats["busy"]
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    calls: list[Any] = []

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        calls.append(state)
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    watched.register_comm_hook("my-state", counting_hook)  # called in the timing hook's place
    again = _step(ledger, lambda: _train_step(watched))
    assert calls == ["my-state"] and again["ops"]["all_reduce"][:2] == [1, _grad_bytes(watched)]


def test_a_model_too_large_to_copy_its_buckets_is_followed_by_their_sizes(
    ledger: CommLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beyond the size whose bucket copy is read, the sizes DDP logs place the launches."""
    monkeypatch.setattr(Buckets, "LAYOUT_READ_MAX_BYTES", 0)
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]), bucket_cap_mb=0.5)
    assert watch_ddp(ledger, ddp) == FOLLOWED

    def train() -> None:
        ddp(torch.randn(4, 256)).sum().backward()

    counts = [_step(ledger, train)["ops"]["all_reduce"][:2] for _ in range(4)]
    assert all(nbytes == _grad_bytes(ddp) for _, nbytes in counts)
    # One bucket at first; DDP logs the three it re-sized them into a step or two later.
    assert counts[0][0] == 1 and counts[-1][0] == 3
