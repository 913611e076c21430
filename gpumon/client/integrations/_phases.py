"""Helpers for integrations whose framework calls hooks instead of running ``with`` blocks."""

from __future__ import annotations

from time import perf_counter

from gpumon.client.monitor import Phase, Step, StepMonitor


class PhaseSequence:
    """Opens and closes a monitor's step and phase contexts from framework callbacks.

    One phase is open at a time: ``switch`` closes the current phase and opens the next.
    """

    def __init__(self, monitor: StepMonitor) -> None:
        self.monitor = monitor
        self._step: Step | None = None
        self._phase: Phase | None = None

    @property
    def in_step(self) -> bool:
        """Whether a step is open."""
        return self._step is not None

    def start_step(
        self,
        wait_start: float | None,
        samples: int | None = None,
        tokens: int | None = None,
        flops: float | None = None,
    ) -> None:
        """Open a step; ``wait_start`` (perf_counter) begins its data wait, if known."""
        if self._step is not None:
            self.end_step()
        if wait_start is not None:
            self.monitor.extensions.data_wait(wait_start, perf_counter())
        self._step = self.monitor.step(samples=samples, tokens=tokens, flops=flops)
        self._step.__enter__()

    def switch(self, name: str) -> None:
        """Close the open phase (if any) and open ``name``, inside an open step."""
        if self._step is None:
            return
        self._close_phase(None)
        self._phase = self.monitor.phase(name)
        self._phase.__enter__()

    def set_counts(self, samples: int | None, tokens: int | None, flops: float | None) -> None:
        """Set the open step's counts, when they are known only after it started."""
        if self._step is not None:
            self._step.set_counts(samples, tokens, flops)

    def end_step(self, exc: BaseException | None = None) -> None:
        """Close the open phase and step; with ``exc``, as if it escaped them."""
        self._close_phase(exc)
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None if exc is None else type(exc), exc, None)

    def _close_phase(self, exc: BaseException | None) -> None:
        phase, self._phase = self._phase, None
        if phase is not None:
            phase.__exit__(None if exc is None else type(exc), exc, None)
