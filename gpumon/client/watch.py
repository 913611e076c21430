"""``StepMonitor.watch(model, optimizer)``: hand the monitor what it cannot see from the loop.

Dispatches on what ``model`` is, by type name (nothing is imported for a plain module):
``DistributedDataParallel`` → its gradient all-reduces (``ddp``); an FSDP module (``fully_shard``
or ``FullyShardedDataParallel``, at the root or inside) → its all-gathers and reduce-scatters
(``comm``'s wrapped collectives); a DeepSpeed engine → listed, not measured yet. All three also
get the training thread's wait for a CPU (``cpu_wait``): what slows a rank slows its peers. Any torch
module → its sampled memory breakdown (``memory``), with the optimizer's states when one is
given (a later call with the optimizer adds it). Anything it
cannot measure it leaves alone and says so once in the log; it never raises into the
training code. Calling it again with the same model does nothing.
"""

from __future__ import annotations

import gc
import logging
import sys
import weakref
from typing import TYPE_CHECKING, Any, TypeVar

from gpumon.client.comm import CommLedger
from gpumon.client.comm_tap import tap_into
from gpumon.client.cpu_wait import CpuWaitClock

if TYPE_CHECKING:
    from gpumon.client.monitor import StepMonitor

log = logging.getLogger("gpumon.client")

M = TypeVar("M")

KINDS = (
    ("ddp", "torch.nn.parallel.distributed", "DistributedDataParallel"),
    ("deepspeed", "deepspeed.runtime.engine", "DeepSpeedEngine"),
    ("fsdp", "torch.distributed.fsdp", "FSDPModule"),  # fully_shard
    ("fsdp", "torch.distributed._composable.fsdp", "FSDPModule"),  # fully_shard, torch < 2.6
    ("fsdp", "torch.distributed.fsdp", "FullyShardedDataParallel"),
)
"""What ``watch`` recognises: (kind, module, class); a module not imported yet is not looked
at (the model cannot be one of its classes)."""


def watch(monitor: StepMonitor, model: M, optimizer: Any = None) -> M:
    """Measure what ``model`` (and ``optimizer``) do in each of ``monitor``'s steps; returns
    ``model``."""
    try:
        _watch_communication(monitor, model)
    except Exception:  # a torch we did not expect: not measured, never a crash
        log.warning("gpumon: could not watch %s's communication", type(model).__name__, exc_info=True)
    try:
        _watch_memory(monitor, model, optimizer)
    except Exception:
        log.warning("gpumon: could not watch %s's memory", type(model).__name__, exc_info=True)
    return model


def _watch_memory(monitor: StepMonitor, model: object, optimizer: Any) -> None:
    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(model).__mro__}
    if "torch.nn.modules.module.Module" not in names:
        return  # not a torch module: nothing to break down
    from gpumon.client.memory import watch_memory

    watch_memory(monitor, model, _torch_optimizer(optimizer))


def _torch_optimizer(optimizer: Any) -> Any:
    """``optimizer``, or the torch optimizer a wrapper holds (Accelerate's, Lightning's), or None."""
    for _ in range(3):
        if optimizer is None:
            return None
        names = {f"{c.__module__}.{c.__qualname__}" for c in type(optimizer).__mro__}
        if "torch.optim.optimizer.Optimizer" in names and hasattr(optimizer, "state"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def kind_of(model: object) -> str | None:
    """``"ddp"``, ``"fsdp"`` (also a plain module with FSDP modules inside), ``"deepspeed"``,
    or None for anything else."""
    for kind, cls in _classes():
        if isinstance(model, cls):
            return kind
    modules = getattr(model, "modules", None)
    fsdp = tuple(cls for kind, cls in _classes() if kind == "fsdp")
    if fsdp and callable(modules) and any(isinstance(sub, fsdp) for sub in modules()):
        return "fsdp"
    return None


def _classes() -> list[tuple[str, type]]:
    found = []
    for kind, module, name in KINDS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append((kind, cls))
    return found


WRAPPER_CLASSES = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine"),
)


def find_wrapper(model: object) -> object | None:
    """The DDP, FSDP or DeepSpeed wrapper whose ``.module`` is ``model``, if one exists.

    For integrations handed the bare model by their trainer (Hugging Face's callbacks get
    ``trainer.model``, not the wrapper Accelerate made). One pass over the objects the garbage
    collector tracks, once per training run: ~0.1 s in a process holding 300,000 of them.
    """
    classes: tuple[type, ...] = tuple(
        cls for module, name in WRAPPER_CLASSES
        if (cls := getattr(sys.modules.get(module), name, None)) is not None
    )
    if not classes:
        return None
    for obj in gc.get_objects():
        if isinstance(obj, classes) and getattr(obj, "module", None) is model:
            found: object = obj
            return found
    return None


def comm_ledger(monitor: StepMonitor) -> CommLedger:
    """The monitor's communication ledger, registered as a step extension on first use."""
    ledger: CommLedger | None = getattr(monitor, "_comm_ledger", None)
    if ledger is None:
        owner = weakref.ref(monitor)  # the monitor holds the ledger: no cycle back to it
        ledger = CommLedger(device_clock=lambda: getattr(owner(), "_cuda", None))
        monitor._comm_ledger = ledger  # type: ignore[attr-defined]
        monitor._add_extension(ledger)
    return ledger


def _watch_communication(monitor: StepMonitor, model: object) -> None:
    kind = kind_of(model)
    if kind is not None and getattr(monitor, "_cpu_wait", None) is None:
        # A rank of a distributed run: its peers wait for whatever slows it, host included.
        monitor._cpu_wait = CpuWaitClock()  # type: ignore[attr-defined]
        monitor._add_extension(monitor._cpu_wait)  # type: ignore[attr-defined]
    if kind == "ddp":
        from gpumon.client.ddp import watch_ddp

        watch_ddp(comm_ledger(monitor), model)
    elif kind == "fsdp":
        if not tap_into(comm_ledger(monitor)):
            log.warning("gpumon: torch.distributed is not available: FSDP communication not measured")
    elif kind == "deepspeed":
        log.warning("gpumon: DeepSpeed engines are not measured yet")
