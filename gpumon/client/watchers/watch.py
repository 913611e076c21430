"""``StepMonitor.watch(model, optimizer)``: hand the monitor what it cannot see from the loop.

Dispatches on what ``model`` is through one table, ``WRAPPERS``: a row per wrapper class
(looked up by module and name, so nothing is imported for a plain module), with its kind and
the function that watches it; a new wrapper is one more row. Today:
``DistributedDataParallel`` → its gradient all-reduces (``ddp``); an FSDP module (``fully_shard``
or ``FullyShardedDataParallel``, at the root or inside) → its all-gathers and reduce-scatters
(``comm``'s wrapped collectives); a DeepSpeed engine → its forward, backward and optimizer
step as phases, a step per accumulation boundary, the collectives ``deepspeed.comm`` makes and
what ZeRO holds on this rank (``deepspeed``, ``deepspeed_memory``). All three also
get the training thread's wait for a CPU (``cpu_wait``): what slows a rank slows its peers. Any torch
module → its sampled memory breakdown (``memory``), with the optimizer's states when one is
given (a later call with the optimizer adds it); its MoE routers → each layer's expert load
(``moe``). Anything it
cannot measure it leaves alone and says so once in the log; it never raises into the
training code. Calling it again with the same model does nothing: each watcher attaches
through ``monitor.extensions.attach``, which registers one extension of each class per monitor.
"""

from __future__ import annotations

import gc
import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from gpumon.client.comm.ledger import CommLedger
from gpumon.client.comm.tap import tap_into
from gpumon.client.watchers.cpu_wait import CpuWaitClock
from gpumon.client.watchers.layout import watch_layout

if TYPE_CHECKING:
    from gpumon.client.core.seam import Watched

log = logging.getLogger("gpumon.client")

M = TypeVar("M")

def watch(monitor: Watched, model: M, optimizer: Any = None) -> M:
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
    try:
        _watch_experts(monitor, model)
    except Exception:
        log.warning("gpumon: could not watch %s's MoE layers", type(model).__name__, exc_info=True)
    return model


def _watch_experts(monitor: Watched, model: object) -> None:
    if callable(getattr(model, "named_modules", None)) and "torch" in sys.modules:
        from gpumon.client.watchers.moe import watch_experts
        watch_experts(monitor, model)


def _watch_memory(monitor: Watched, model: object, optimizer: Any) -> None:
    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(model).__mro__}
    if "torch.nn.modules.module.Module" not in names:
        return  # not a torch module: nothing to break down
    from gpumon.client.watchers.memory import watch_memory

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
    wrapper = _wrapper_of(model)
    return None if wrapper is None else wrapper.kind


def _wrapper_of(model: object) -> Wrapper | None:
    """The row of ``WRAPPERS`` ``model`` is an instance of, else the first row marked ``nests``
    one of its submodules is an instance of, else None."""
    found = _loaded()
    for wrapper, cls in found:
        if isinstance(model, cls):
            return wrapper
    nesting = [(wrapper, cls) for wrapper, cls in found if wrapper.nests]
    modules = getattr(model, "modules", None)
    if nesting and callable(modules):
        for sub in modules():
            for wrapper, cls in nesting:
                if isinstance(sub, cls):
                    return wrapper
    return None


def _loaded() -> list[tuple[Wrapper, type]]:
    """The rows of ``WRAPPERS`` whose module is imported, with their class."""
    found = []
    for wrapper in WRAPPERS:
        cls = getattr(sys.modules.get(wrapper.module), wrapper.name, None)
        if isinstance(cls, type):
            found.append((wrapper, cls))
    return found


def find_wrapper(model: object) -> object | None:
    """The DDP, FSDP or DeepSpeed wrapper whose ``.module`` is ``model``, if one exists.

    For integrations handed the bare model by their trainer (Hugging Face's callbacks get
    ``trainer.model``, not the wrapper Accelerate made). One pass over the objects the garbage
    collector tracks, once per training run: ~0.1 s in a process holding 300,000 of them.
    """
    classes = tuple(cls for wrapper, cls in _loaded() if wrapper.holds_model)
    if not classes:
        return None
    for obj in gc.get_objects():
        if isinstance(obj, weakref.ProxyTypes):  # a dead proxy raises on isinstance()
            continue
        if isinstance(obj, classes) and getattr(obj, "module", None) is model:
            found: object = obj
            return found
    return None


def comm_ledger(monitor: Watched) -> CommLedger:
    """The monitor's communication ledger, attached as a step extension on first use."""
    device_clock = monitor.extensions.device_clock  # not the monitor: a tap keeps the ledger
    return monitor.extensions.attach(CommLedger, lambda: CommLedger(device_clock=device_clock))


def _watch_communication(monitor: Watched, model: object) -> None:
    wrapper = _wrapper_of(model)
    if wrapper is None:
        if not _distributed():
            return
        # A rank of a model-parallel job (a pipeline stage, tensor parallelism) or one whose
        # code calls the collectives itself: its transfers and collectives, wherever issued.
        if not tap_into(comm_ledger(monitor)):
            return
    else:
        wrapper.watch(monitor, model)
    # A rank of a distributed run: its peers wait for whatever slows it, host included.
    monitor.extensions.attach(CpuWaitClock)
    watch_layout(monitor, model)


def _distributed() -> bool:
    """A process of a job of more than one rank, once ``torch.distributed`` is initialised."""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized()
                    and dist.get_world_size() > 1)
    except Exception:
        return False


def _watch_ddp(monitor: Watched, model: object) -> None:
    from gpumon.client.watchers.ddp import watch_ddp

    watch_ddp(comm_ledger(monitor), model)


def _watch_fsdp(monitor: Watched, model: object) -> None:
    if not tap_into(comm_ledger(monitor)):
        log.warning("gpumon: torch.distributed is not available: FSDP communication not measured")


def _watch_deepspeed(monitor: Watched, engine: Any) -> None:
    from gpumon.client.watchers.deepspeed import rebind_backend, time_gather_waits, watch_engine, zero_stage
    from gpumon.client.watchers.deepspeed_memory import DeepSpeedHoldings
    from gpumon.client.watchers.memory import watch_memory

    watch_engine(monitor, engine)
    monitor.extensions.describe("deepspeed", zero_stage(engine))
    ledger = comm_ledger(monitor)
    if tap_into(ledger):
        rebind_backend()
        time_gather_waits(ledger)
    else:
        log.warning("gpumon: torch.distributed is not available: DeepSpeed communication not measured")
    watch_memory(monitor, engine, _torch_optimizer(getattr(engine, "optimizer", None)),
                 DeepSpeedHoldings(engine))


@dataclass(frozen=True, slots=True)
class Wrapper:
    """A distributed wrapper ``watch()`` recognises, and how it watches one."""

    kind: str
    """What ``kind_of`` answers: ``ddp``, ``fsdp``, ``deepspeed``."""
    module: str
    """Where the class lives; a module not imported yet is not looked at (the model cannot
    be one of its classes)."""
    name: str
    """The class's name in ``module``."""
    watch: Callable[[Watched, Any], None]
    """Attaches what measures its communication (after the wait for a CPU, which every
    wrapper gets)."""
    holds_model: bool
    """Its ``.module`` is the user's model: ``find_wrapper`` looks for it."""
    nests: bool = False
    """May sit inside a plain module (FSDP's units): ``kind_of`` looks at the submodules too."""


WRAPPERS: tuple[Wrapper, ...] = (
    Wrapper("ddp", "torch.nn.parallel.distributed", "DistributedDataParallel", _watch_ddp,
            holds_model=True),
    Wrapper("deepspeed", "deepspeed.runtime.engine", "DeepSpeedEngine", _watch_deepspeed,
            holds_model=True),
    Wrapper("fsdp", "torch.distributed.fsdp", "FSDPModule", _watch_fsdp,  # fully_shard
            holds_model=False, nests=True),
    Wrapper("fsdp", "torch.distributed._composable.fsdp", "FSDPModule", _watch_fsdp,  # torch < 2.6
            holds_model=False, nests=True),
    Wrapper("fsdp", "torch.distributed.fsdp", "FullyShardedDataParallel", _watch_fsdp,
            holds_model=True, nests=True),
)
"""Every wrapper ``watch()`` knows, in the order they are tried: a new one is one row."""
