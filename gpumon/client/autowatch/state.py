"""What each of ``gpumon run``'s hooks does once past its compile test, and the state they share.

``hooks`` puts the hooks into torch; each hands its event to a method of the process's state:
``call`` (a module call: the training thread's outermost one is the forward), ``backward``,
``fetch`` (a DataLoader's next batch: the data phase), ``optimizer_pre`` and ``optimizer_post``
(the outermost optimizer step ends the step). Only the training thread's events count; anything
else passes straight through. The events go to the process's ``StepFinder`` (``steps``).

``PythonState`` is the reference, written in Python, and is what runs where the monitor's core
is Python. Where it is C, ``State`` is ``_hook.HookState``'s subclass: each event's common case
(the training thread, a C finder, the model or optimizer met last) runs in C, and everything else
in ``PythonState``'s methods (``python_call``, ...), called before anything has changed.

What the process does about its watch is the subclass's (``hooks``): making the finder
(``open_finder``), giving up after an error in gpumon's own work (``give_up``, which the C part
calls too), and learning the models (``forward_unseen``, ``learnt_step``). Errors in gpumon's own
work never reach the training loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any

from gpumon.client.autowatch import steps
from gpumon.client.autowatch.met import Met
from gpumon.client.autowatch.steps import StepFinder

if TYPE_CHECKING or steps._CStepFinder is None:  # (the C state drives the C finder only)
    _HookState = None
else:
    from gpumon.client.core._hook import HookState as _HookState

_get_ident = threading.get_ident


class PythonState:
    """This process's watch: what the hooks share (touched by the training thread only), and
    what each hook does once it has passed its compile test."""

    def __init__(self) -> None:
        self.compiler: Any = None  # what holds _is_compiling_flag (torch.compiler), once installed
        self.reset()

    def reset(self) -> None:
        """A new watch (in place: the C hooks hold the state)."""
        self.main = threading.main_thread().ident or 0
        self.finder: StepFinder | None = None
        self.inert = False  # decided: this process is not watched
        self.module_depth = 0
        self.optimizer_depth = 0
        self.met = Met()  # the modules and optimizers met, each watched once
        self.last_module: Callable[[], Any] | None = None  # a weak reference to the last one called
        self.last_optimizer: Callable[[], Any] | None = None  # ... to the last one stepped
        self.learning = 0  # optimizer steps left before the wrap narrows (0: it does not)
        self.forward_seen = False  # an outermost forward since the last optimizer step

    # What the process does about its watch (``hooks``).

    def open_finder(self) -> StepFinder | None:
        """The process's step finder, made on the first event; None while it is not watched."""
        raise NotImplementedError

    def give_up(self, error: BaseException | None = None) -> None:
        """An error in gpumon's own work (``error``, or the one being handled): stop watching
        this process."""
        raise NotImplementedError

    def forward_unseen(self) -> None:
        """A backward begins with no outermost forward seen since the last optimizer step."""

    def learnt_step(self) -> None:
        """An optimizer step ended while the models are learnt (``learning`` is not 0)."""

    # The hooks' events.

    def call(self, original: Callable[..., Any], module: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """``original(module, *args, **kwargs)``; the training thread's outermost module call
        is the forward (its module watched the first time)."""
        if self.module_depth or self.inert or _get_ident() != self.main:  # inside a forward
            return original(module, *args, **kwargs)
        finder = self.finder
        try:
            if finder is None:
                finder = self.open_finder()
            if finder is not None:
                last = self.last_module
                if last is None or last() is not module:
                    self.last_module = self.met.module(finder, module)
                finder.forward_begin()
        except Exception:
            self.give_up()
            finder = None
        if finder is None:
            return original(module, *args, **kwargs)
        self.module_depth = 1
        self.forward_seen = True
        try:
            return original(module, *args, **kwargs)
        finally:
            self.module_depth = 0
            try:
                finder.forward_end()
            except Exception:
                self.give_up()

    def backward(self, original: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``original(*args, **kwargs)``, timed as the backward."""
        if self.inert or _get_ident() != self.main:
            return original(*args, **kwargs)
        finder = self.finder
        try:
            if finder is None:
                finder = self.open_finder()
            if finder is not None:
                if not self.forward_seen:
                    self.forward_unseen()
                finder.backward_begin()
        except Exception:
            self.give_up()
            finder = None
        if finder is None:
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            try:
                finder.end()
            except Exception:
                self.give_up()

    def fetch(self, original: Callable[[Any], Any], iterator: Any) -> Any:
        """``original(iterator)``, a DataLoader's next batch: the wait for it is the data
        phase."""
        if self.inert or _get_ident() != self.main:
            return original(iterator)
        finder = self.finder
        if finder is not None and finder.lingering:  # a forward left open ends here
            try:
                finder.settle()
            except Exception:
                self.give_up()
                return original(iterator)
        t0 = perf_counter()
        try:
            batch = original(iterator)
        except StopIteration:
            self._fetched(t0, None, False)
            raise
        self._fetched(t0, batch, True)
        return batch

    def _fetched(self, t0: float, batch: Any, got: bool) -> None:
        t1 = perf_counter()
        try:
            finder = self.finder or self.open_finder()
            if finder is not None:
                self.optimizer_depth = 0  # a batch is never fetched inside an optimizer step
                finder.fetched(t0, t1, batch, got)
        except Exception:
            self.give_up()

    def optimizer_pre(self, optimizer: Any) -> None:
        """An optimizer step begins (the outermost one opens the optimizer phase)."""
        if self.inert or _get_ident() != self.main:
            return
        self.optimizer_depth += 1
        if self.optimizer_depth == 1:
            try:
                finder = self.finder or self.open_finder()
                if finder is not None:
                    last = self.last_optimizer
                    if last is None or last() is not optimizer:
                        self.last_optimizer = self.met.optimizer(finder, optimizer)
                    finder.optimizer_begin()
            except Exception:
                self.give_up()

    def optimizer_post(self, optimizer: Any) -> None:
        """An optimizer step ended (the outermost one ends the step)."""
        if self.inert or _get_ident() != self.main or not self.optimizer_depth:
            return
        self.optimizer_depth -= 1
        finder = self.finder
        if not self.optimizer_depth and finder is not None:
            try:
                finder.optimizer_end(id(optimizer))
                self.forward_seen = False
                if self.learning and not self.inert:
                    self.learnt_step()
            except Exception:
                self.give_up()


if TYPE_CHECKING or _HookState is None:
    State = PythonState
else:
    class State(_HookState, PythonState):
        """``PythonState`` with the common case of each event in C (``_hook.HookState``)."""

        python_call = PythonState.call
        python_backward = PythonState.backward
        python_fetch = PythonState.fetch
        python_optimizer_pre = PythonState.optimizer_pre
        python_optimizer_post = PythonState.optimizer_post
