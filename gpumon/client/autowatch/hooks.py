"""The hooks ``gpumon run`` puts into PyTorch, once torch is imported in a process it started.

``install()`` adds, process-wide: torch's global optimizer step hooks (pre and post), and
wrappers around module calls, ``torch.autograd.backward`` (which ``Tensor.backward`` calls),
the DataLoader iterator's ``__next__`` and ``torch.compile`` (``compiler``). Not torch's global
module hooks: they would take every module call off its fast path, and make
``torch.compile``'d modules warn. Each reacts only on the process's main thread, the training
thread, and only to the outermost call (a module's forward inside another's, an optimizer that
wraps another); anything else returns at once.
What they see goes to a ``StepFinder`` (``steps``), made with its ``StepMonitor`` on the first
event, when the rank is known.

What each hook does past its compile test is a method of the process's state (``state``,
where it runs in C where it can); this module gives the state what the process does about its
watch (``_Watch``: its finder, giving up, learning the models). Where the monitor's core is C,
the backward and DataLoader hooks are ``_hook.Hooked`` objects, with no Python frame of their
own; the model-call wrapper and the optimizer hooks stay Python functions for their compile
test. The state is reset in place (``reset()``), never replaced: the C hooks hold it.

Module calls are wrapped in two stages (``calls`` does the wrapping). For the first
``LEARN_STEPS`` optimizer steps, ``Module.__call__`` itself: every module call passes the
wrapper, and the outermost ones with parameters are the models. Then only the models' classes
get a ``__call__`` of their own, the wrapper (a DDP or FSDP module's class, a DeepSpeed
engine's, ``OptimizedModule``, the user's model class), and ``Module.__call__`` is torch's
again: the modules inside a model, and a parameter-less loss module, cost nothing more. A
model first called after that is not seen (its forward is timed as whatever phase is open)
until a backward comes with no forward seen since the last optimizer step: the wrap then
widens again, to learn it (and narrows for good if that learns no new class). Once
``torch.compile`` has traced anything in the process, the wrap stays as it is: what it traced
through a wrapper is guarded on it, and would be compiled again. ``take_out()`` restores every
class as it was; ``install()`` on the same watch puts the narrowed wrap straight back; a forked
child learns afresh.

The modules and optimizers met are ``watch()``ed once each (``met``): communication for a
DDP, FSDP or DeepSpeed module, the memory breakdown for any model, with its optimizer's states.

Inside a region ``torch.compile`` is tracing, every hook returns at its first line
(``torch.compiler.is_compiling()``, in two parts, which the compiler reads as a constant), and
the backward and DataLoader wrappers are run by it as Python runs them (``compiler``): nothing
of gpumon is traced, so it breaks no graph. A compiled model is timed from outside: its whole
forward, the backward of its compiled graph. A compiled optimizer step runs the optimizer hooks
inside the compiled region, where they return: it is not seen.

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
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpumon.client import monitor as _monitor_module
from gpumon.client.autowatch import calls, compiler, steps
from gpumon.client.autowatch.state import State
from gpumon.client.autowatch.steps import StepFinder, step_finder
from gpumon.client.core.comm_inflight import STEP_OPENERS
from gpumon.client.core.progress import PROGRESS as _PROGRESS
from gpumon.client.core.progress import torch_compiled
from gpumon.client.monitor import StepMonitor
from gpumon.client.side_channels import watch_checkpoints

if TYPE_CHECKING or steps._CStepFinder is None:  # (the C hooks drive the C finder only)
    _Hooked = None
else:
    from gpumon.client.core._hook import Hooked as _Hooked

log = logging.getLogger("gpumon.client")


LEARN_STEPS = 4
"""Optimizer steps during which every module call is looked at, to learn the models."""

_dynamo_compiling: Callable[[], bool] = lambda: False  # noqa: E731 (torch's, once installed)
_compiler: Any = None  # torch.compiler, once installed (``compiler.tracing``)


class _Watch(State):
    """The process's watch: the hooks' state (``state``), with what the process does about it."""

    def reset(self) -> None:
        super().reset()
        self.narrowed = False  # only the models' classes' calls are wrapped
        self.relearn = True  # a backward with no forward before it widens the wrap again
        self.classes_learnt = 0  # how many classes were known when it last widened

    def open_finder(self) -> StepFinder | None:
        if self.finder is not None:
            return self.finder
        if self.inert:
            return None
        self.inert = True  # until a monitor is made: an error below leaves the process unwatched
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
        self.finder = step_finder(mon)
        self.inert = False
        return self.finder

    def give_up(self, error: BaseException | None = None) -> None:
        log.debug("gpumon: stopped watching this process", exc_info=error or True)
        finder, self.finder, self.inert = self.finder, None, True
        if finder is not None:
            try:
                finder.monitor.close()
            except Exception:
                pass

    def forward_unseen(self) -> None:
        if self.narrowed and self.relearn and calls.any_wrapped():
            _relearn()

    def learnt_step(self) -> None:
        self.learning -= 1
        if not self.learning and calls.any_wrapped():
            _narrow()


_state = _Watch()
_handles: list[Any] = []
_fork_handler = False
_restore: list[Callable[[], None]] = []
make_monitor: Callable[[], StepMonitor] = StepMonitor
"""How the process's monitor is made (run, rank and socket from the environment)."""


def install() -> bool:
    """Put the hooks into torch (imported by now); False if this torch lacks what they need."""
    global _dynamo_compiling, _compiler, _fork_handler
    if _handles or _restore:
        return True
    try:
        import torch
        import torch.utils.data.dataloader as dataloader
        from torch.optim import optimizer
    except ImportError:
        return False
    torch_compiler = getattr(torch, "compiler", None)
    if not (hasattr(torch_compiler, "is_compiling")
            and hasattr(optimizer, "register_optimizer_step_post_hook")):
        return False
    _dynamo_compiling, _compiler = compiler.tracing(torch_compiler)
    if _state.inert:  # taken out by uninstall(): a new watch
        _state.reset()
    _state.compiler = _compiler
    _handles.append(optimizer.register_optimizer_step_pre_hook(_optimizer_pre))
    _handles.append(optimizer.register_optimizer_step_post_hook(_optimizer_post))
    backward = _patch(torch.autograd, "backward", _wrap_backward)
    next_ = _patch(dataloader._BaseDataLoaderIter, "__next__", _wrap_next)

    def run_as_python() -> None:
        compiler.run_as_python(torch.autograd, "backward", backward)
        compiler.run_as_python(dataloader._BaseDataLoaderIter, "__next__", next_)

    _patch(torch, "compile", lambda original: _wrap_compile(original, run_as_python))
    watch_checkpoints()  # a restore before the first step counts too
    if torch_compiled():  # the job compiled before the hooks went in
        run_as_python()
    if _state.narrowed:  # put back after take_out(): the models are known
        _narrow()
    else:
        _widen(learn=_state.relearn)  # (no relearning: compiled code depends on the wrap)
    if _open_for_transfer not in STEP_OPENERS:
        STEP_OPENERS.append(_open_for_transfer)
    if not _fork_handler:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _monitor_module._on_new_monitor.append(_monitor_made)
        _fork_handler = True
    return True


def uninstall() -> None:
    """Take every hook out again and forget this process's watch (its monitor is closed)."""
    take_out()
    finder = _state.finder
    _state.reset()
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
    if _open_for_transfer in STEP_OPENERS:
        STEP_OPENERS.remove(_open_for_transfer)
    for restore in _restore:
        restore()
    _restore.clear()
    calls.unwrap()


def _patch(owner: Any, name: str, wrap: Callable[[Any], Any]) -> Callable[..., Any]:
    """Put ``wrap(owner.name)`` in its place (until ``take_out()``); the wrapper."""
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    wrapper: Callable[..., Any] = functools.wraps(original)(wrap(original))
    setattr(owner, name, wrapper)
    _restore.append(lambda: setattr(owner, name, original))
    return wrapper


# --- which module calls are wrapped (``calls``): every one while the models are learnt (the
# first LEARN_STEPS optimizer steps), then only the models' classes' ---------------------


def _widen(learn: bool = True) -> None:
    """Wrap every module's call (``Module.__call__``); with ``learn``, narrow the wrap again
    after ``LEARN_STEPS`` optimizer steps."""
    _state.narrowed = False
    _state.learning = LEARN_STEPS if learn else 0
    calls.wrap_every_call(_wrap_call)


def _narrow() -> None:
    """Wrap the calls of the models' classes only, and no longer ``Module.__call__`` (unless
    compiled code may depend on the wrap: it then stays as it is)."""
    state = _state
    if not state.narrowed:
        if not state.met.classes:  # no model met yet (nothing to gain yet): learn on
            state.learning = LEARN_STEPS
            return
        if torch_compiled():
            state.learning = 0
            state.relearn = False
            return
    state.learning = 0
    state.narrowed = True
    if len(state.met.classes) <= state.classes_learnt:
        state.relearn = False  # widened for a forward it could not see, and learnt nothing
    calls.wrap_class_calls(state.met.classes, _wrap_call)


def _relearn() -> None:
    """A backward with no forward seen before it: a model not learnt yet (first called once
    the wrap was narrowed) is trained; every module call is looked at again for a while."""
    state = _state
    if torch_compiled():
        state.relearn = False
        return
    state.classes_learnt = len(state.met.classes)
    _widen()


def _others() -> int:
    """Open monitors in this process that are not gpumon run's."""
    finder = _state.finder
    return sum(1 for m in list(_monitor_module._live_monitors)
               if not m._closed and (finder is None or m is not finder.monitor))


def _monitor_made(monitor: StepMonitor) -> None:
    """A monitor was made in this process: if it is not gpumon's, look at the end of the next
    step whether the job now watches itself (``_after_step``)."""
    finder = _state.finder
    if finder is not None and monitor is not finder.monitor:
        finder.on_step_end = _after_step


def _open_for_transfer() -> Callable[[], None] | None:
    """A point-to-point transfer, or a wait on one, on the training thread with no step open
    (a pipeline stage waiting for its first micro-batch, before any forward): open the step
    there, the transfer as its ``comm`` phase, as a hand-hooked loop's ``mon.step()`` around
    the schedule would. What closes the phase once the call returns, or None."""
    finder = _state.finder
    if (finder is None or finder.in_step or finder.driven
            or threading.current_thread() is not threading.main_thread()):
        return None
    finder.begin("comm")
    return finder.end


def _after_step() -> None:
    finder = _state.finder
    if finder is not None:
        finder.on_step_end = None
    if _others():
        # The job started watching itself: one count of its steps, its own. The hooks stay
        # (removing one while torch runs them would break its loop) and return at once.
        state = _state
        finder, state.finder, state.inert = state.finder, None, True
        if finder is not None:
            finder.close()
            finder.monitor.close()


def _after_fork_in_child() -> None:
    _state.reset()  # the parent's monitor is closed here (``monitor``'s own fork handler)
    if calls.any_wrapped():
        _widen()  # the child learns its own models


# --- the hooks: each passes its compile test, then hands its event to the state (``state``) ---


def _wrap_call(original: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _dynamo_compiling() or _compiler._is_compiling_flag:
            return original(self, *args, **kwargs)
        _PROGRESS.noted += 1  # a model call: progress, for the stall watch
        return _state.call(original, self, args, kwargs)

    return __call__


def _optimizer_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _dynamo_compiling() or _compiler._is_compiling_flag:
        return
    _state.optimizer_pre(optimizer)


def _optimizer_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _dynamo_compiling() or _compiler._is_compiling_flag:
        return
    _state.optimizer_post(optimizer)


def _wrap_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    if _Hooked is not None:
        return _Hooked(_state, original, "backward")  # (its compile test: the flag)

    def backward(*args: Any, **kwargs: Any) -> Any:
        if _dynamo_compiling() or _compiler._is_compiling_flag:
            return original(*args, **kwargs)
        return _state.backward(original, *args, **kwargs)

    return backward


def _wrap_compile(original: Callable[..., Any], run_as_python: Callable[[], None]) -> Callable[..., Any]:
    def compile(*args: Any, **kwargs: Any) -> Any:
        compiled = original(*args, **kwargs)
        try:  # the job compiles: the compiler must leave the backward and DataLoader wrappers alone
            run_as_python()
        except Exception:
            _state.give_up()
        return compiled

    return compile


def _wrap_next(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    if _Hooked is not None:
        return _Hooked(_state, original, "fetch")  # (binds to the iterator as a method)

    def __next__(self: Any) -> Any:
        return _state.fetch(original, self)

    return __next__
