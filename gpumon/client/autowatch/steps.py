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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpumon.client._phases import batch_size
from gpumon.client.monitor import Phase, Step, StepMonitor


class StepFinder:
    """Turns training-thread events into the monitor's steps and phases (see the module
    docstring). ``on_step_end()`` is called after each step closes."""

    def __init__(self, monitor: StepMonitor, on_step_end: Callable[[], object] | None = None) -> None:
        self.monitor = monitor
        self._on_step_end = on_step_end
        self._step: Step | None = None
        self._stack: list[Phase] = []  # phases begun and not ended; the top one is open
        self._phases: dict[str, Phase] = {}
        self._samples = 0
        self._deferred = False  # an optimizer stepped in the open step; another may follow
        self._since_fetch: list[int] | None = None  # optimizers stepped since the last fetch
        self._followed: set[int] = set()  # optimizers seen followed by another on one batch
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
        if self._deferred and not self.driven:
            self._close()
        self._since_fetch = []
        if not got:
            return
        size = batch_size(batch)
        if size is not None:
            self._samples += size
        # Outside a step this starts the next one at t0 (it opens at the next forward, when
        # what the first forward watches is attached).
        self.monitor.extensions.data_wait(t0, t1)

    def begin(self, name: str) -> None:
        """A phase begins: ``forward``, ``backward`` or ``optimizer``."""
        if self.driven:
            return
        if self._step is None:
            self._open()
        stack = self._stack
        if stack:
            stack[-1].__exit__(None, None, None)
        phase = self._phases.get(name)
        if phase is None:
            phase = self._phases[name] = self.monitor.phase(name)
        stack.append(phase)
        phase.__enter__()

    def end(self) -> None:
        """The innermost phase begun ends."""
        stack = self._stack
        if stack:
            stack.pop().__exit__(None, None, None)
            if stack:
                stack[-1].__enter__()

    def optimizer_begin(self) -> None:
        """An optimizer step begins (the outermost one, if optimizers wrap others)."""
        self.begin("optimizer")

    def optimizer_end(self, optimizer_id: int) -> None:
        """That optimizer step ended: the step closes unless ``optimizer_id`` is known to be
        followed by another optimizer on the same batch."""
        if self.driven:
            return
        self.end()
        since = self._since_fetch
        if since is not None:
            if since and since[-1] != optimizer_id:
                self._followed.add(since[-1])
            since.append(optimizer_id)
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
        if self._step is None:
            step = self.monitor.step()
            step.__enter__()
            self._step = step

    def _end_phases(self) -> None:
        stack = self._stack
        if stack:
            stack[-1].__exit__(None, None, None)
            stack.clear()

    def _close(self) -> None:
        self._end_phases()
        step, self._step = self._step, None
        self._deferred = False
        if step is None:
            return
        if self._samples:
            step.set_counts(self._samples, None, None)
            self._samples = 0
        step.__exit__(None, None, None)
        if self._on_step_end is not None:
            self._on_step_end()
