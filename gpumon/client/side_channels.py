"""What a monitor keeps with the agent beside its step records: the step ring a crash leaves
readable (``core/ring.py``), the channel for the profiler traces the agent asks for
(``trace_control.py``), and the checkpoint taps that report time outside the steps
(``watchers/checkpoints.py``). Each is set up here from what the monitor hands over; none ever
raises into the monitor's construction.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpumon.client.core.ring import StepRing, open_ring

if TYPE_CHECKING:
    from gpumon.client.core.cuda_clock import CudaClock
    from gpumon.client.core.extensions import Extensions
    from gpumon.client.core.spans import SpanReporter
    from gpumon.client.trace_control import TraceControl

log = logging.getLogger("gpumon.client")


def step_ring(set_ring: Callable[[StepRing], None]) -> StepRing | None:
    """A ring each completed step is also written to as it ends, for the agent to read should
    the process die before sending it, handed to the core by ``set_ring``; None where there is
    none (turned off, no memfd) or the core cannot use the mapping."""
    ring = open_ring()
    if ring is None:
        return None
    try:
        set_ring(ring)
    except (ValueError, BufferError):
        ring.close()
        return None
    return ring


def trace_control(socket_path: str, run: str, rank: int, world: int | None, core: Any,
                  sender: Any, extensions: Extensions,
                  clock: Callable[[], CudaClock | None]) -> TraceControl | None:
    """The monitor's channel for profiler traces the agent asks for; ``GPUMON_TRACE=0`` turns
    it off."""
    if os.environ.get("GPUMON_TRACE") == "0":
        return None
    from gpumon.client.trace_control import TraceControl

    return TraceControl(socket_path, run, rank, world, core, sender, extensions, clock)


def watch_checkpoints(spans: SpanReporter | None = None) -> None:
    """Recognise the process's checkpoint saves and evaluations for ``spans`` (None: from now,
    for the monitor to come: ``gpumon run``'s hooks); never raises."""
    try:
        from gpumon.client.watchers.checkpoints import watch_checkpoints as watch

        watch(spans)
    except Exception:  # a failure here costs the recognition, never the monitor
        log.debug("checkpoint taps not installed", exc_info=True)
