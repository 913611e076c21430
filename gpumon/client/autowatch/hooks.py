"""The hooks ``gpumon run`` puts into PyTorch, once torch is imported in a process it started.

``install()`` adds, process-wide: torch's global optimizer step hooks (pre and post), and
wrappers around module calls, ``torch.autograd.backward`` (which ``Tensor.backward`` calls) and
the DataLoader iterator's ``__next__``. Not torch's global module hooks: they would take every
module call off its fast path, and make ``torch.compile``'d modules warn. Each reacts only on
the process's main thread, the training thread, and only to the outermost call (a module's
forward inside another's, an optimizer that wraps another); anything else returns at once.
What they see goes to a ``StepFinder`` (``steps``), made with its ``StepMonitor`` on the first
event, when the rank is known.

Module calls are wrapped in two stages. For the first ``LEARN_STEPS`` optimizer steps,
``Module.__call__`` itself: every module call passes the wrapper, and the outermost ones with
parameters are the models. Then only the models' classes get a ``__call__`` of their own, the
wrapper (a DDP or FSDP module's class, a DeepSpeed engine's, ``OptimizedModule``, the user's
model class), and ``Module.__call__`` is torch's again: the modules inside a model, and a
parameter-less loss module, cost nothing more. A model first called after that is not seen
(its forward is timed as whatever phase is open) until a backward comes with no forward seen
since the last optimizer step: the wrap then widens again, to learn it (and narrows for good
if that learns no new class). Once ``torch.compile`` has traced anything in the process, the
wrap stays as it is: what it traced through a wrapper is guarded on it, and would be compiled
again. ``take_out()`` restores every class as it was (a class that had no ``__call__`` of its
own has none again); ``install()`` on the same watch puts the narrowed wrap straight back; a
forked child learns afresh.

The first outermost forward of each module with parameters ``watch()``es it: a
``DistributedDataParallel``, FSDP or DeepSpeed module gets its communication measured, any
module its memory breakdown; the first step of each optimizer adds it to the watch of the
modules whose parameters it updates (its states and master copies in the breakdown).

Inside a region ``torch.compile`` is tracing, every hook returns at its first line
(``torch.compiler.is_compiling()``, which the compiler reads as a constant): nothing of gpumon is
traced, so it breaks no graph. A compiled model is timed from outside: its whole forward, the
backward of its compiled graph, its optimizer step.

The process stays unwatched (every hook returns at once) when it is a DataLoader worker, when
the job watches itself (a ``StepMonitor`` of its own, the Lightning or Hugging Face callback:
it then counts its steps once, itself; one made after gpumon's own closes gpumon's), when a
monitor cannot be made, and with ``GPUMON_RUN_DISABLE=1``. A forked child starts afresh: a
DataLoader worker forked from a rank finds itself a worker, a rank forked from a launcher
watches itself.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from time import perf_counter
from typing import Any

from gpumon.client import monitor as _monitor_module
from gpumon.client.autowatch.steps import StepFinder
from gpumon.client.monitor import StepMonitor

log = logging.getLogger("gpumon.client")


LEARN_STEPS = 4
"""Optimizer steps during which every module call is looked at, to learn the models."""


def _nothing() -> None:
    return None


class _State:
    """This process's watch: what the hooks share (touched by the training thread only)."""

    def __init__(self) -> None:
        self.main = threading.main_thread().ident
        self.finder: StepFinder | None = None
        self.inert = False  # decided: this process is not watched
        self.module_depth = 0
        self.optimizer_depth = 0
        self.seen: dict[int, weakref.ref[Any]] = {}  # modules looked at, by id
        self.last_module: Callable[[], Any] = _nothing  # a reference to the last one called
        self.models: weakref.WeakSet[Any] = weakref.WeakSet()  # ... those with parameters
        self.paired: dict[int, weakref.ref[Any]] = {}  # optimizers, by id
        self.last_optimizer: Callable[[], Any] = _nothing  # a reference to the last one stepped
        self.classes: dict[type, None] = {}  # the classes of the models
        self.narrowed = False  # only the models' classes' calls are wrapped
        self.learning = 0  # optimizer steps left before the wrap narrows (0: it does not)
        self.forward_seen = False  # an outermost forward since the last optimizer step
        self.relearn = True  # a backward with no forward before it widens the wrap again
        self.classes_learnt = 0  # how many classes were known when it last widened


_state = _State()
_handles: list[Any] = []
_fork_handler = False
_get_ident = threading.get_ident
_restore: list[Callable[[], None]] = []
_restore_calls: list[Callable[[], None]] = []  # the module call wrappers, global or per class
_is_compiling: Callable[[], bool] = lambda: False  # noqa: E731 (torch's, once installed)
_torch_module: Any = None  # torch.nn.Module, once the wrap narrowed
make_monitor: Callable[[], StepMonitor] = StepMonitor
"""How the process's monitor is made (run, rank and socket from the environment)."""


def install() -> bool:
    """Put the hooks into torch (imported by now); False if this torch lacks what they need."""
    global _is_compiling, _state, _fork_handler
    if _handles or _restore:
        return True
    try:
        import torch
        import torch.utils.data.dataloader as dataloader
        from torch.optim import optimizer
    except ImportError:
        return False
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if compiling is None or not hasattr(optimizer, "register_optimizer_step_post_hook"):
        return False
    _is_compiling = compiling
    if _state.inert:  # taken out by uninstall(): a new watch
        _state = _State()
    _handles.append(optimizer.register_optimizer_step_pre_hook(_optimizer_pre))
    _handles.append(optimizer.register_optimizer_step_post_hook(_optimizer_post))
    _patch(torch.autograd, "backward", _wrap_backward)
    _patch(dataloader._BaseDataLoaderIter, "__next__", _wrap_next)
    if _state.narrowed:  # put back after take_out(): the models are known
        _narrow()
    else:
        _widen(learn=_state.relearn)  # (no relearning: compiled code depends on the wrap)
    if not _fork_handler:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_handler = True
    return True


def uninstall() -> None:
    """Take every hook out again and forget this process's watch (its monitor is closed)."""
    global _state
    take_out()
    finder = _state.finder
    _state = _State()
    _state.inert = True
    if finder is not None:
        finder.close()
        finder.monitor.close()


def take_out() -> None:
    """Take every hook out of torch, keeping this process's watch: ``install()`` puts them back
    on the same monitor (to compare a job with and without them in one process)."""
    for handle in _handles:
        handle.remove()
    _handles.clear()
    for restore in _restore:
        restore()
    _restore.clear()
    _unwrap_calls()


def _patch(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(wrap(original)))
    _restore.append(lambda: setattr(owner, name, original))


# --- which module calls are wrapped -------------------------------------------------------
# While the models are learnt (the first LEARN_STEPS optimizer steps), ``Module.__call__``:
# every module call passes through the wrapper. Then only the classes of the models (the
# outermost modules with parameters seen) have a ``__call__`` of their own, the wrapper: the
# modules inside them, and the loss functions, are called as torch calls them, at no cost.


def _widen(learn: bool = True) -> None:
    """Wrap every module's call (``Module.__call__``); with ``learn``, narrow the wrap again
    after ``LEARN_STEPS`` optimizer steps."""
    from torch.nn.modules import module

    _unwrap_calls()
    _state.narrowed = False
    _state.learning = LEARN_STEPS if learn else 0
    _wrap_class_call(module.Module, module.Module.__dict__["__call__"])


def _compiled() -> bool:
    """Whether ``torch.compile`` has traced code in this process: what it traced through a
    module call wrapper is guarded on it, and would be compiled again if it changed."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return False
    try:
        return bool(utils.counters["frames"]["total"])
    except Exception:
        return True


def _narrow() -> None:
    """Wrap the calls of the models' classes only, and no longer ``Module.__call__`` (unless
    compiled code may depend on the wrap: it then stays as it is)."""
    state = _state
    if not state.narrowed:
        if not state.classes:  # no model met yet (nothing to gain yet): learn on
            state.learning = LEARN_STEPS
            return
        if _compiled():
            state.learning = 0
            state.relearn = False
            return
    state.learning = 0
    _unwrap_calls()
    state.narrowed = True
    if len(state.classes) <= state.classes_learnt:
        state.relearn = False  # widened for a forward it could not see, and learnt nothing
    # Each class's own call, as the class defines it; one it inherits from ``Module`` is looked
    # up there at each call, so that a patch of ``Module.__call__`` (``torch.fx``'s tracer
    # records submodule calls so) still reaches the models' instances.
    global _torch_module
    from torch.nn.modules import module

    _torch_module = module.Module
    originals = [(cls, next(c for c in cls.__mro__ if "__call__" in c.__dict__)) for cls in state.classes]
    for cls, owner in originals:
        _wrap_class_call(cls, _module_call if owner is module.Module else owner.__dict__["__call__"])


def _module_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Module.__call__`` as it is now (torch's, or a patch in place over it)."""
    return _torch_module.__call__(self, *args, **kwargs)


def _wrap_class_call(cls: type, original: Callable[..., Any]) -> None:
    own = cls.__dict__.get("__call__")
    wrapper = functools.wraps(original)(_wrap_call(original))
    cls.__call__ = wrapper  # type: ignore[method-assign]

    def restore() -> None:
        if cls.__dict__.get("__call__") is wrapper:
            if own is None:
                delattr(cls, "__call__")
            else:
                cls.__call__ = own  # type: ignore[method-assign]

    _restore_calls.append(restore)


def _unwrap_calls() -> None:
    for restore in reversed(_restore_calls):
        restore()
    _restore_calls.clear()


def _relearn() -> None:
    """A backward with no forward seen before it: a model not learnt yet (first called once
    the wrap was narrowed) is trained; every module call is looked at again for a while."""
    state = _state
    if _compiled():
        state.relearn = False
        return
    state.classes_learnt = len(state.classes)
    _widen()


def _finder() -> StepFinder | None:
    """The process's step finder, made on the first event; None while it is not watched."""
    state = _state
    if state.finder is not None:
        return state.finder
    if state.inert:
        return None
    state.inert = True  # until a monitor is made: an error below leaves the process unwatched
    try:
        import torch.utils.data

        if torch.utils.data.get_worker_info() is not None:
            return None  # a DataLoader worker: its batches are the rank's data wait
        if _others():
            return None  # the job watches itself
        mon = make_monitor()
    except Exception:
        log.debug("gpumon: this process is not watched", exc_info=True)
        return None
    quiet = logging.getLogger("gpumon")  # what gpumon logs must not change what the job prints
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    state.finder = StepFinder(mon, on_step_end=_after_step)
    state.inert = False
    return state.finder


def _others() -> int:
    """Open monitors in this process that are not gpumon run's."""
    finder = _state.finder
    return sum(1 for m in list(_monitor_module._live_monitors)
               if not m._closed and (finder is None or m is not finder.monitor))


def _after_step() -> None:
    if len(_monitor_module._live_monitors) > 1 and _others():
        # The job started watching itself: one count of its steps, its own. The hooks stay
        # (removing one while torch runs them would break its loop) and return at once.
        state = _state
        finder, state.finder, state.inert = state.finder, None, True
        if finder is not None:
            finder.close()
            finder.monitor.close()


def _after_fork_in_child() -> None:
    global _state
    _state = _State()  # the parent's monitor is closed here (``monitor``'s own fork handler)
    if _restore_calls:
        _widen()  # the child learns its own models


# --- the hooks: each returns at once unless it is the training thread's outermost call ----
# An error in what they do beyond that leaves the process unwatched from then on
# (``_give_up``), and never reaches the training loop.


def _give_up() -> None:
    """An error in gpumon's own work: stop watching this process."""
    log.debug("gpumon: stopped watching this process", exc_info=True)
    state = _state
    finder, state.finder, state.inert = state.finder, None, True
    if finder is not None:
        try:
            finder.monitor.close()
        except Exception:
            pass


def _wrap_call(original: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state
        if state.module_depth or state.inert:  # inside a forward already: as fast as can be
            return original(self, *args, **kwargs)
        if _is_compiling() or _get_ident() != state.main:
            return original(self, *args, **kwargs)
        finder = state.finder
        try:
            if finder is None:
                finder = _finder()
            if finder is not None:
                if state.last_module() is not self:
                    _met(finder, self)
                finder.forward_begin()
        except Exception:
            _give_up()
            finder = None
        if finder is None:
            return original(self, *args, **kwargs)
        state.module_depth = 1
        state.forward_seen = True
        try:
            return original(self, *args, **kwargs)
        finally:
            state.module_depth = 0
            try:
                finder.forward_end()
            except Exception:
                _give_up()

    return __call__


def _optimizer_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _is_compiling():
        return
    state = _state
    if state.inert or _get_ident() != state.main:
        return
    state.optimizer_depth += 1
    if state.optimizer_depth == 1:
        try:
            finder = state.finder or _finder()
            if finder is not None:
                if state.last_optimizer() is not optimizer:
                    _pair(finder, optimizer)
                finder.optimizer_begin()
        except Exception:
            _give_up()


def _optimizer_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _is_compiling():
        return
    state = _state
    if state.inert or _get_ident() != state.main or not state.optimizer_depth:
        return
    state.optimizer_depth -= 1
    finder = state.finder
    if not state.optimizer_depth and finder is not None:
        try:
            finder.optimizer_end(id(optimizer))
            state.forward_seen = False
            if state.learning and not state.inert:
                state.learning -= 1
                if not state.learning and _restore_calls:
                    _narrow()
        except Exception:
            _give_up()


def _wrap_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(*args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return original(*args, **kwargs)
        state = _state
        if state.inert or _get_ident() != state.main:
            return original(*args, **kwargs)
        finder = state.finder
        try:
            if finder is None:
                finder = _finder()
            if finder is not None:
                if not state.forward_seen and state.narrowed and state.relearn and _restore_calls:
                    _relearn()
                finder.backward_begin()
        except Exception:
            _give_up()
            finder = None
        if finder is None:
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            try:
                finder.end()
            except Exception:
                _give_up()

    return backward


def _wrap_next(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def __next__(self: Any) -> Any:
        state = _state
        if state.inert or _get_ident() != state.main:
            return original(self)
        finder = state.finder
        if finder is not None and finder.lingering:  # a forward left open ends here
            try:
                finder.settle()
            except Exception:
                _give_up()
        t0 = perf_counter()
        try:
            batch = original(self)
        except StopIteration:
            _fetched(state, t0, None, False)
            raise
        t1 = perf_counter()
        try:
            if finder is None:
                finder = _finder()
            if finder is not None:
                state.optimizer_depth = 0  # a batch is never fetched inside an optimizer step
                finder.fetched(t0, t1, batch, True)
        except Exception:
            _give_up()
        return batch

    return __next__


def _fetched(state: _State, t0: float, batch: Any, got: bool) -> None:
    try:
        finder = state.finder or _finder()
        if finder is not None:
            state.optimizer_depth = 0  # a batch is never fetched inside an optimizer step
            finder.fetched(t0, perf_counter(), batch, got)
    except Exception:
        _give_up()


def _met(finder: StepFinder, module: Any) -> None:
    """An outermost forward of another module than the last one: looked at if it is new."""
    state = _state
    seen = state.seen
    key = id(module)
    ref = seen.get(key)
    if ref is None or ref() is not module:
        # (a module that cannot be weakly referenced: the process is unwatched)
        ref = seen[key] = weakref.ref(module, lambda r: seen.pop(key) if seen.get(key) is r else None)
        _look_at(finder, module)
    state.last_module = ref


def _look_at(finder: StepFinder, module: Any) -> None:
    """``watch()`` a module seen for the first time in an outermost forward, if it has
    parameters (a loss function, say, has none); its class is then a model's."""
    state = _state
    try:
        if next(iter(module.parameters()), None) is None:
            return
        state.models.add(module)
        state.classes[type(module)] = None
        finder.monitor.watch(module)
        if _drives_steps(finder.monitor):
            finder.close()  # a step opened before (a forward of another module): not its own
            finder.driven = True
    except Exception:
        log.debug("gpumon: could not watch %s", type(module).__name__, exc_info=True)


def _drives_steps(monitor: StepMonitor) -> bool:
    """Whether a watcher attached to ``monitor`` makes the steps itself: a DeepSpeed engine's
    (``gpumon.client.deepspeed``'s ``StepDriver``), whose steps are its accumulation boundaries
    and whose phases its own forward, backward and step."""
    driver = getattr(sys.modules.get("gpumon.client.deepspeed"), "StepDriver", None)
    return isinstance(driver, type) and monitor.extensions.get(driver) is not None


def _pair(finder: StepFinder, optimizer: Any) -> None:
    """Another optimizer than the last one steps: if it is its first step, watch it with the
    modules whose parameters it updates."""
    state = _state
    paired = state.paired
    key = id(optimizer)
    ref = paired.get(key)
    if ref is not None and ref() is optimizer:
        state.last_optimizer = ref
        return
    ref = paired[key] = weakref.ref(optimizer, lambda r: paired.pop(key) if paired.get(key) is r else None)
    state.last_optimizer = ref
    try:
        updated = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in list(_state.models):
            if any(id(p) in updated for p in model.parameters()):
                finder.monitor.watch(model, optimizer)
    except Exception:
        log.debug("gpumon: could not watch %s", type(optimizer).__name__, exc_info=True)
