"""A step's collective communication as the verdicts read it: the wait, the overlap, bus bandwidth.

Two sources describe a step's communication. A ``comm`` phase is timed by hand around a
collective the training loop calls itself; the ``comm`` field of the record is measured by
the client's watcher (``StepMonitor.watch``) from the collectives DDP and FSDP launch inside
backward. Both say how long the training thread was blocked on collectives, so the two are
never added: a loop that times a ``comm`` phase *and* is watched would otherwise count the
same wait twice. The larger of the two is the step's collective wait.

The measured wait does not sit in a ``comm`` phase: under DDP it is inside ``backward`` (the
last buckets' all-reduce), under FSDP also inside ``forward`` (parameter all-gathers), under
ZeRO inside the optimizer step. ``attributed_phases`` takes it back out of those phases, so
that compute means the time the rank worked, not the time it waited for its peers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gpumon.wire import StepRecord

__all__ = ["BUS_FACTORS", "attributed_phases", "bus_bandwidth_factor", "overlapped_s",
           "phases_less_wait", "wait_s"]

WAIT_HOSTS = ("backward", "forward", "optimizer")
"""Phases a measured collective wait is taken out of, in this order: DDP's and FSDP's
gradient reductions wait at the end of backward, FSDP's all-gathers in forward, ZeRO's
parameter all-gathers in the optimizer step."""

BUS_FACTORS: Mapping[str, tuple[int, int]] = {
    "all_reduce": (2, -2),
    "reduce_scatter": (1, -1),
    "all_gather": (1, -1),
    "all_to_all": (1, -1),
    "broadcast": (1, 0),
    "reduce": (1, 0),
    "send": (1, 0),
    "recv": (1, 0),
}
"""nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md) as (a, b) in (a·n + b) / n for n
ranks: all-reduce 2(n−1)/n, reduce-scatter, all-gather and all-to-all (n−1)/n, broadcast,
reduce and point-to-point 1. Bus bandwidth = algorithm bandwidth (bytes ÷ seconds) × factor:
the figure that compares with the links' peak whatever the rank count."""


def wait_s(step: StepRecord) -> float | None:
    """Seconds the training thread was blocked on collectives in ``step``: the measured
    exposed time or the hand-timed ``comm`` phase, whichever is larger (never their sum);
    ``None`` when the step carries neither."""
    phase = step.phases_s.get("comm")
    measured = step.comm.exposed_s if step.comm is not None else None
    values = [v for v in (phase, measured) if v is not None and math.isfinite(v) and v >= 0]
    return max(values) if values else None


def overlapped_s(step: StepRecord) -> float | None:
    """Seconds collectives were in flight while the rank kept working (busy − exposed);
    ``None`` unless the step's communication was measured."""
    if step.comm is None:
        return None
    return max(0.0, step.comm.busy_s - step.comm.exposed_s)


def attributed_phases(step: StepRecord) -> dict[str, float]:
    """The step's (finite, positive) phases with its collective wait in ``comm`` alone.

    The part of the measured wait a hand-timed ``comm`` phase does not already hold is taken
    out of ``WAIT_HOSTS`` in order (none goes below zero) and added to ``comm``. What no host
    phase can give back stays in the step's unattributed time, where it was.
    """
    return phases_less_wait(step, wait_s(step))


def phases_less_wait(step: StepRecord, wait: float | None) -> dict[str, float]:
    """``attributed_phases`` of a step whose ``wait_s`` is known already (the report's bins
    read both of a million steps)."""
    phases = {k: v for k, v in step.phases_s.items() if math.isfinite(v) and v > 0}
    if wait is None:
        return phases
    excess = wait - phases.get("comm", 0.0)
    for name in WAIT_HOSTS:
        if excess <= 0:
            break
        taken = min(excess, phases.get(name, 0.0))
        if taken > 0:
            phases[name] -= taken
            excess -= taken
            if phases[name] <= 0:
                del phases[name]
    if wait > 0:
        phases["comm"] = wait
    return phases


def bus_bandwidth_factor(op: str, world: int | None) -> float | None:
    """nccl-tests' bus-bandwidth factor of collective ``op`` over ``world`` ranks; ``None``
    for an op it does not define or an unknown world size."""
    factor = BUS_FACTORS.get(op)
    if factor is None or world is None or world < 1:
        return None
    a, b = factor
    return (a * world + b) / world
