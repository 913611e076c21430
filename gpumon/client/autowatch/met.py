"""The modules and optimizers ``gpumon run``'s hooks meet, each ``watch()``ed once.

The first outermost forward of each module with parameters ``watch()``es it: a
``DistributedDataParallel``, FSDP or DeepSpeed module gets its communication measured, any
module its memory breakdown, and its class is a model's (the classes the module-call wrap
narrows to, ``calls``). The first step of each optimizer adds it to the watch of the modules
whose parameters it updates (its states and master copies in the breakdown). Each is given
back as a weak reference: the hooks keep the last module and optimizer met by it, so a step's
events check them by identity alone.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

from gpumon.client.autowatch.steps import StepFinder
from gpumon.client.monitor import StepMonitor

log = logging.getLogger("gpumon.client")


class Met:
    """What the hooks met (touched by the training thread only)."""

    def __init__(self) -> None:
        self.seen: dict[int, weakref.ref[Any]] = {}  # modules looked at, by id
        self.models: weakref.WeakSet[Any] = weakref.WeakSet()  # ... those with parameters
        self.classes: dict[type, None] = {}  # the classes of the models
        self.paired: dict[int, weakref.ref[Any]] = {}  # optimizers, by id

    def module(self, finder: StepFinder, module: Any) -> weakref.ref[Any]:
        """An outermost forward of another module than the last one: looked at if it is new.
        A weak reference to it."""
        seen = self.seen
        key = id(module)
        ref = seen.get(key)
        if ref is None or ref() is not module:
            ref = _remember(seen, module)  # (one that cannot be: the process is unwatched)
            self._look_at(finder, module)
        return ref

    def _look_at(self, finder: StepFinder, module: Any) -> None:
        """``watch()`` a module seen for the first time in an outermost forward, if it has
        parameters (a loss function, say, has none); its class is then a model's."""
        try:
            if next(iter(module.parameters()), None) is None:
                return
            self.models.add(module)
            self.classes[type(module)] = None
            finder.monitor.watch(module)
            if _drives_steps(finder.monitor):
                finder.close()  # a step opened before (a forward of another module): not its own
                finder.driven = True
        except Exception:
            log.debug("gpumon: could not watch %s", type(module).__name__, exc_info=True)

    def optimizer(self, finder: StepFinder, optimizer: Any) -> weakref.ref[Any]:
        """Another optimizer than the last one steps: if it is its first step, watch it with
        the modules whose parameters it updates. A weak reference to it."""
        paired = self.paired
        key = id(optimizer)
        ref = paired.get(key)
        if ref is not None and ref() is optimizer:
            return ref
        ref = _remember(paired, optimizer)
        try:
            updated = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for model in list(self.models):
                if any(id(p) in updated for p in model.parameters()):
                    finder.monitor.watch(model, optimizer)
        except Exception:
            log.debug("gpumon: could not watch %s", type(optimizer).__name__, exc_info=True)
        return ref


def _remember(table: dict[int, weakref.ref[Any]], obj: Any) -> weakref.ref[Any]:
    """A weak reference to ``obj`` kept in ``table`` under its id, dropped when ``obj`` is."""
    key = id(obj)

    def forget(ref: weakref.ref[Any]) -> None:
        if table.get(key) is ref:
            del table[key]

    ref = table[key] = weakref.ref(obj, forget)
    return ref


def _drives_steps(monitor: StepMonitor) -> bool:
    """Whether a watcher attached to ``monitor`` makes the steps itself: a DeepSpeed engine's
    (``gpumon.client.watchers.deepspeed``'s ``StepDriver``), whose steps are its accumulation boundaries
    and whose phases its own forward, backward and step."""
    driver = getattr(sys.modules.get("gpumon.client.watchers.deepspeed"), "StepDriver", None)
    return isinstance(driver, type) and monitor.extensions.get(driver) is not None
