"""The verdict rules' table (docs/architecture.md §7 rules 2–6): the walls a step can hit, the
figures of a step the rules read (``Shares``), and one row (``Rule``) per way a step shows a
wall, with the threshold it fires from and its strength. ``bottleneck.classify`` measures the
shares and tries the rows in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from gpumon.analysis.thresholds import Thresholds

__all__ = ["MODERATE_RULES", "RULES", "UNKNOWN_STRENGTH", "Bottleneck", "Rule", "Shares", "margin"]


class Bottleneck(str, Enum):
    """The wall a step is hitting (the five walls, docs/architecture.md §1, plus host and unknown)."""

    INPUT = "input"
    HOST = "host"
    COMMUNICATION = "communication"
    MEMORY_BANDWIDTH = "memory_bandwidth"
    COMPUTE = "compute"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Shares:
    """What the rules read of a step: its measured shares and its GPU's activity over it."""

    data: float | None
    """Data-wait share of the step; ``None`` when it reported no phases."""
    comm: float | None
    """Exposed communication share, at most the rank's typical share (``recent_comm``)."""
    bubble: float | None
    """Share of the step spent waiting to receive from another rank (a pipeline stage's
    bubble); ``None`` when it received nothing point to point."""
    busy: float | None
    """GPU busy share over the part of the step not spent waiting (``_busy_excluding_waits``)."""
    gpu_busy: bool
    """The GPU was not seen to idle (unknown counts as busy: the GPU rows then decide)."""
    sm: float | None
    tensor: float | None
    dram: float | None
    mfu: float | None
    below_ridge: bool
    """Arithmetic intensity under the device's ridge point, at the bandwidth roof."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of docs/architecture.md §7: a figure of the step, the threshold from which it
    shows a wall, and how strongly.

    The row fires when ``reads`` gives a figure at or above ``low``; its strength is then
    ``base + span × m``, ``m`` being where the figure lies between ``low`` (0) and ``high``
    (1). A wall with two rows (bandwidth from GPM or from the roofline) takes the stronger
    of those that fired.
    """

    wall: Bottleneck
    reads: Callable[[Shares, Thresholds], float | None]
    low: Callable[[Thresholds], float]
    high: Callable[[Thresholds], float]
    base: float = 0.6
    span: float = 0.4

    def strength(self, shares: Shares, th: Thresholds) -> float | None:
        """The row's strength on ``shares``; ``None`` when it does not fire."""
        value = self.reads(shares, th)
        low = self.low(th)
        if value is None or value < low:
            return None
        return self.base + self.span * margin(value, low, self.high(th))


def _idle(s: Shares, th: Thresholds) -> float | None:
    """How far under the host line (rule 4) the GPU's busy share sat."""
    if s.busy is None or s.busy >= th.host_busy_max:
        return None
    return th.host_busy_max - s.busy


def _dram_not_math(s: Shares, th: Thresholds) -> float | None:
    """DRAM activity of a busy GPU whose tensor cores idle (rule 5, from GPM)."""
    if not s.gpu_busy or s.tensor is None or s.tensor >= th.membw_tensor_max:
        return None
    return s.dram


def _dram_below_ridge(s: Shares, th: Thresholds) -> float | None:
    """DRAM activity of a busy GPU under the roofline's ridge point (rule 5, from flops)."""
    return s.dram if s.gpu_busy and s.below_ridge else None


def _sm_and_tensor(s: Shares, th: Thresholds) -> float | None:
    """How far both SM and tensor activity of a busy GPU are past their lines (rule 6, GPM)."""
    if (not s.gpu_busy or s.sm is None or s.tensor is None
            or s.sm < th.compute_sm_min or s.tensor < th.compute_tensor_min):
        return None
    return min(margin(s.sm, th.compute_sm_min, 1.0),
               margin(s.tensor, th.compute_tensor_min, 0.9))


def _mfu_of_busy(s: Shares, th: Thresholds) -> float | None:
    """MFU of a busy GPU (rule 6, from flops)."""
    return s.mfu if s.gpu_busy else None


RULES: tuple[Rule, ...] = (
    # wall, figure read, fires from, full strength at, strength base and span
    Rule(Bottleneck.INPUT, lambda s, th: s.data, lambda th: th.input_high_fraction,
         lambda th: 0.5),
    Rule(Bottleneck.COMMUNICATION, lambda s, th: s.comm, lambda th: th.comm_high_fraction,
         lambda th: 0.5),
    Rule(Bottleneck.HOST, _idle, lambda th: 0.0, lambda th: th.host_busy_max),
    Rule(Bottleneck.MEMORY_BANDWIDTH, _dram_not_math, lambda th: th.membw_dram_min,
         lambda th: 0.9),
    Rule(Bottleneck.MEMORY_BANDWIDTH, _dram_below_ridge, lambda th: th.roofline_dram_min,
         lambda th: 0.9, base=0.55, span=0.35),
    Rule(Bottleneck.COMPUTE, _sm_and_tensor, lambda th: 0.0, lambda th: 1.0),
    Rule(Bottleneck.COMPUTE, _mfu_of_busy, lambda th: th.compute_mfu_min, lambda th: 0.6),
)
"""The walls of docs/architecture.md §7 rules 2–6, in the order they are tried."""

MODERATE_RULES: tuple[Rule, ...] = (
    Rule(Bottleneck.INPUT, lambda s, th: s.data, lambda th: th.input_moderate_fraction,
         lambda th: th.input_high_fraction, base=0.3, span=0.2),
    Rule(Bottleneck.COMMUNICATION, lambda s, th: s.comm, lambda th: th.comm_moderate_fraction,
         lambda th: th.comm_high_fraction, base=0.3, span=0.2),
)
"""Tried when no row of ``RULES`` fired and the GPU was seen: the larger moderate share."""

UNKNOWN_STRENGTH = 0.3
"""The strength of an unknown verdict, before its missing inputs lower it."""


def margin(value: float, low: float, high: float) -> float:
    """Where ``value`` lies between ``low`` (0) and ``high`` (1), clipped."""
    if high <= low:
        return 1.0 if value >= high else 0.0
    return min(1.0, max(0.0, (value - low) / (high - low)))
