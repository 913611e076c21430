"""Where an unmodified training loop's steps begin and end, from what PyTorch reports.

``StepFinder`` is told, on the training thread, of the events the hooks see (``hooks``): a
batch fetched from a DataLoader, the outermost module's forward, the backward pass, an
optimizer step. It opens and closes the monitor's step and phases from them, as a hand-hooked
loop would with ``with`` blocks:

* A step opens at the first forward, backward or optimizer step after the previous one
  closed, and starts at the moment its first batch was asked for, if one was fetched before.
  Time the loop spends between an optimizer step and its next batch or forward (logging, a
  learning-rate schedule) is outside every step, as it is in a hooked loop whose
  ``with mon.step()`` sits inside the ``for batch in loader``.
* A step closes when an optimizer step ends: one step per ``optimizer.step()``, however many
  parameter groups it has, so gradient accumulation over four micro-batches is one step.
* Several optimizers stepping back to back on one batch (a GAN's discriminator, then its
  generator) are one step: once an optimizer has been seen followed by another's step before the
  next batch was fetched, its steps leave the step open for the one that follows (or for the
  next fetch). That is learnt from the first such batch, which counts one step per optimizer.
  A loop that fetches no batches from a DataLoader gets one step per optimizer step.
* Phases: ``data`` (the wait for a batch), ``forward``, ``backward``, ``optimizer``; one is
  open at a time. Work nested in another (the forward and backward an optimizer's closure runs,
  as Lightning's does; a checkpointed forward recomputed in backward) is timed as itself, and
  the outer phase resumes when it ends.
* A forward that is not nested in another phase stays open when it ends, until the next event
  (the backward, an optimizer step, another forward, which then continues it, or the next
  batch asked for: ``settle()``): what the loop computes between its model's forward and the
  backward, the loss, counts as forward, as it does in a hand-hooked loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpumon.client.core.batches import batch_size
from gpumon.client.monitor import IMPLEMENTATION, Phase, Step, StepMonitor

if TYPE_CHECKING or IMPLEMENTATION != "c" or os.environ.get("GPUMON_PURE_PYTHON"):
    _CStepFinder = None
else:
    from gpumon.client.core._hook import StepFinder as _CStepFinder


def step_finder(monitor: StepMonitor, on_step_end: Callable[[], object] | None = None) -> StepFinder:
    """A finder for ``monitor``'s steps: ``gpumon.client.core._hook``'s, where the monitor's core is
    C too (it then drives the core's steps and phases with no Python frame between: per step,
    ``gpumon run`` makes 10 Python calls of its own instead of 32), else this module's, which
    it follows statement by statement."""
    if _CStepFinder is not None:
        finder: StepFinder = _CStepFinder(monitor, on_step_end)
        return finder
    return StepFinder(monitor, on_step_end)


class StepFinder:
    """Turns training-thread events into the monitor's steps and phases (see the module
    docstring). ``on_step_end()``, while not ``None``, is called after each step closes."""

    def __init__(self, monitor: StepMonitor, on_step_end: Callable[[], object] | None = None) -> None:
        self.monitor = monitor
        self.on_step_end = on_step_end
        self._step: Step | None = None
        self._next_step: Step | None = None  # the step context, reused from step to step
        self._stack: list[Phase] = []  # phases begun and not ended; the top one is open
        self._forward = monitor.phase("forward")
        self._backward = monitor.phase("backward")
        self._optimizer = monitor.phase("optimizer")
        self._phases: dict[str, Phase] = {
            "forward": self._forward, "backward": self._backward, "optimizer": self._optimizer}
        self._samples = 0
        self._counted = False  # the step context holds a count of samples
        self._deferred = False  # an optimizer stepped in the open step; another may follow
        # The last optimizer stepped since the last fetch: 0 if none, None if no batch was ever
        # fetched from a DataLoader.
        self._last_optimizer: int | None = None
        self._followed: set[int] = set()  # optimizers seen followed by another on one batch
        self._data_wait = monitor.extensions.data_wait
        self.lingering = False
        """The top-level forward ended and is left open until the next event (``settle()``)."""
        self.driven = False
        """A watcher makes the steps and phases itself (a DeepSpeed engine's, at its
        accumulation boundaries): only the data wait is reported from here."""

    @property
    def in_step(self) -> bool:
        """Whether a step is open."""
        return self._step is not None

    def fetched(self, t0: float, t1: float, batch: Any, got: bool = True) -> None:
        """The training thread waited from ``t0`` to ``t1`` (perf_counter) for a batch; ``got``
        is False when the loader was exhausted instead."""
        if self.lingering:
            self.settle()
        if self._deferred and not self.driven:
            self._close()
        self._last_optimizer = 0
        if not got:
            return
        size = batch_size(batch)
        if size is not None:
            self._samples += size
        # Outside a step this starts the next one at t0 (it opens at the next forward, when
        # what the first forward watches is attached).
        self._data_wait(t0, t1)

    def begin(self, name: str) -> None:
        """A phase begins: ``forward``, ``backward`` or ``optimizer``."""
        if name == "forward":
            self.forward_begin()
            return
        phase = self._phases.get(name)
        if phase is None:
            phase = self._phases[name] = self.monitor.phase(name)
        self._begin(phase)

    # The hooks' events (a forward continues one left open; see ``end()``).

    def forward_begin(self) -> None:
        """An outermost forward begins."""
        if self.driven:
            return
        stack = self._stack
        if self.lingering:  # the top-level forward left open: this one continues it
            self.lingering = False
            stack.append(stack[-1])  # still open; the matching end() leaves it open again
            return
        if stack:
            stack[-1].__exit__(None, None, None)
        if self._step is None:
            self._open()
        phase = self._forward
        stack.append(phase)
        phase.__enter__()

    def backward_begin(self) -> None:
        """A backward pass begins."""
        self._begin(self._backward)

    def optimizer_begin(self) -> None:
        """An optimizer step begins (the outermost one, if optimizers wrap others)."""
        self._begin(self._optimizer)

    def _begin(self, phase: Phase) -> None:
        if self.driven:
            return
        stack = self._stack
        if self.lingering:  # the top-level forward left open ends here
            self.lingering = False
            stack.pop().__exit__(None, None, None)
        elif stack:
            stack[-1].__exit__(None, None, None)
        if self._step is None:
            self._open()
        stack.append(phase)
        phase.__enter__()

    def end(self) -> None:
        """The innermost phase begun ends (a top-level forward is left open: ``settle()``)."""
        stack = self._stack
        if stack:
            phase = stack.pop()
            if stack:
                if stack[-1] is phase:  # a forward that continued a lingering one
                    self.lingering = True
                else:
                    phase.__exit__(None, None, None)
                    stack[-1].__enter__()
            elif phase is self._forward:
                stack.append(phase)
                self.lingering = True
            else:
                phase.__exit__(None, None, None)

    def forward_end(self) -> None:
        """The outermost forward ends: as ``end()``, with a top-level one's case first."""
        if len(self._stack) == 1:  # the forward alone: left open
            self.lingering = True
        else:
            self.end()

    def settle(self) -> None:
        """End a top-level forward left open (the loop asks for its next batch, say)."""
        if self.lingering:
            self.lingering = False
            stack = self._stack
            if stack:
                stack.pop().__exit__(None, None, None)

    def optimizer_end(self, optimizer_id: int) -> None:
        """That optimizer step ended: the step closes unless ``optimizer_id`` is known to be
        followed by another optimizer on the same batch."""
        if self.driven:
            return
        self.end()
        last = self._last_optimizer
        if last is not None:
            if last and last != optimizer_id:
                self._followed.add(last)
            self._last_optimizer = optimizer_id
        if optimizer_id in self._followed:
            self._deferred = True
        else:
            self._close()

    def close(self) -> None:
        """Drop an open step without recording it (the job ended, or the monitor stands down)."""
        self._end_phases()
        step, self._step = self._step, None
        if step is not None:
            error = RuntimeError("the step was left open")
            step.__exit__(RuntimeError, error, None)  # not recorded
        self._deferred = False
        self._samples = 0

    def _open(self) -> None:
        step = self._next_step
        if step is None:
            step = self._next_step = self.monitor.step()
        step.__enter__()
        self._step = step

    def _end_phases(self) -> None:
        self.lingering = False
        stack = self._stack
        if stack:
            stack[-1].__exit__(None, None, None)
            stack.clear()

    def _close(self) -> None:
        if self._stack:
            self._end_phases()
        step = self._step
        self._deferred = False
        if step is None:
            return
        self._step = None
        samples = self._samples
        if samples or self._counted:  # the step context is reused: its counts set each time
            self._samples = 0
            self._counted = bool(samples)
            step.set_counts(samples or None, None, None)
        step.__exit__(None, None, None)
        if self.on_step_end is not None:
            self.on_step_end()
