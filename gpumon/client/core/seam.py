"""The monitor as its watchers see it: what ``StepMonitor.watch`` hands a watcher.

A watcher reaches the monitor only through this seam, its extension point
(``core/extensions.py``) and its step and phase timers, so no watcher imports the monitor and
the monitor can import the watchers without closing a circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpumon.client.core.extensions import Extensions
    from gpumon.client.core.step_core import Phase, Step


class Watched(Protocol):
    """A monitor as its watchers see it (``StepMonitor`` is one): its extension point, and the
    step and phase timers, for a watcher that opens the steps itself (a DeepSpeed engine whose
    loop runs no ``with mon.step()``)."""

    extensions: Extensions

    def step(self) -> Step: ...

    def phase(self, name: str) -> Phase: ...
