"""The slow rank of a synchronous run: found from who waits for whom, and why it is slow.

Each rank's own work (step time less its collective wait, ``own_work_s``) is compared with its
peers' (``straggler_scores``); ``judge_run`` flags the one rank whose own work is materially and
persistently above theirs and names its cause. The rule, its thresholds and their reasons:
docs/architecture.md §7 rule 8.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from gpumon.analysis.comm import wait_s
from gpumon.analysis.thresholds import DEFAULT, Thresholds
from gpumon.wire import StepRecord

__all__ = [
    "STRAGGLER_MIN_STEPS",
    "RankWork",
    "SlowerRank",
    "Standing",
    "StragglerCause",
    "judge_run",
    "own_work_s",
    "straggler_scores",
]

STRAGGLER_MIN_STEPS = 24
"""Steps a rank's comparison window must cover before it can be flagged: a straggler is a
rank slower over a run of steps, and a couple of dozen steps of a training job are seconds
to a minute, while the episodes of a host's CPU contention that make one rank slower are
mostly shorter. On a host with more runnable threads than cores, a balanced two-rank DDP
job still had one such episode pass a 16-step window (on 2 of its 40 steps); none passed 24.
"""

INPUT_SHARE_MIN = 0.5
"""Share of a straggler's extra time per step that must be extra data wait for its cause to
be ``input`` (then the data pipeline, not the rank's compute, is what its peers wait for)."""
HOST_SHARE_MIN = 0.5
"""Share of a straggler's extra time per step that must be extra wait for a CPU for its cause
to be ``host``."""


class StragglerCause(str, Enum):
    """Why a straggler is slow, as far as the evidence says."""

    INPUT = "input"
    HOST = "host"
    COMPUTE = "compute"
    GPU = "gpu"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class RankWork:
    """One rank's recent steps, per step, as the comparison reads them."""

    own_s: float
    """Median own work: step time minus the time blocked on collectives."""
    data_s: float | None = None
    """Median data wait (0 for steps without a ``data`` phase); ``None`` when the rank
    reported no phases, so its own work cannot be split."""
    sm_clock_hz: float | None = None
    """Mean SM clock of its GPU over its latest analysed step."""
    gpu_trouble: bool = False
    """Its GPU was throttled during its latest analysed step, or has reported XID errors."""
    own_low_s: float | None = None
    """Lower quartile of its own work over the same steps (``None``: taken as ``own_s``)."""
    own_high_s: float | None = None
    """Upper quartile of its own work over the same steps (``None``: taken as ``own_s``)."""
    step_s: float | None = None
    """Median step time; ``None`` when not known (the extra's share is then not checked)."""
    cpu_wait_s: float | None = None
    """Median wait of its training thread for a CPU; ``None`` when not measured."""
    steps: int | None = None
    """Steps the window covers; ``None`` when the figures are not from a window of steps
    (a single comparison: persistence is then not checked)."""


@dataclass(frozen=True, slots=True)
class SlowerRank:
    """The rank of the run whose peers wait for it in the collectives."""

    rank: int
    silent: bool = False
    """It stopped reporting while the rest of the run kept stepping."""


@dataclass(frozen=True, slots=True)
class Standing:
    """What comparing a rank with its peers says about it."""

    score: float | None = None
    """Peers' mean own work ÷ its own; ``None`` without peers to compare with."""
    cause: StragglerCause | None = None
    """Set when this rank is a straggler."""
    slower_rank: SlowerRank | None = None
    """Set on the other ranks of a run that has a straggler (or a rank that went silent)."""


def own_work_s(step: StepRecord) -> float:
    """Seconds of ``step`` the rank spent on its own work: its duration less its collective
    wait (``comm.wait_s``), never below zero."""
    return max(0.0, step.duration_s - (wait_s(step) or 0.0))


def straggler_scores(own_s_by_rank: Mapping[int, float]) -> dict[int, float]:
    """Per rank, the mean own work of the *other* ranks ÷ its own (1 = like its peers).

    Needs at least two ranks with a positive, finite own work, else returns ``{}``; ranks
    without one get no score.
    """
    valid = {r: t for r, t in own_s_by_rank.items() if math.isfinite(t) and t > 0}
    if len(valid) < 2:
        return {}
    total = sum(valid.values())
    peers = len(valid) - 1
    return {rank: (total - own) / peers / own for rank, own in valid.items()}


def judge_run(works: Mapping[int, RankWork], silent: frozenset[int] = frozenset(),
              thresholds: Thresholds = DEFAULT) -> dict[int, Standing]:
    """Every compared rank's standing among the ranks of one run (``works``, by rank).

    ``silent`` ranks stopped reporting while the others kept stepping: they are not in
    ``works``; the lowest of them is named as the rank the others wait on when no reporting
    rank is a straggler (its peers' long waits have no other explanation in view).
    """
    scores = straggler_scores({rank: work.own_s for rank, work in works.items()})
    flagged = {r for r, s in scores.items()
               if s < thresholds.straggler_score_max and _material(r, works, thresholds)
               and _persistent(r, works)}
    stragglers = sorted((scores[r], r) for r in flagged)
    slower: SlowerRank | None = None
    if stragglers:
        slower = SlowerRank(stragglers[0][1])
    elif silent:
        slower = SlowerRank(min(silent), silent=True)
    standings = {}
    for rank in works:
        score = scores.get(rank)
        if rank in flagged:
            cause = _cause(rank, works, thresholds)
            standings[rank] = Standing(score, cause, None)
        else:
            standings[rank] = Standing(score, None, slower)
    return standings


def _material(rank: int, works: Mapping[int, RankWork], th: Thresholds) -> bool:
    """Its extra own work is at least ``straggler_extra_share_min`` of its step."""
    culprit = works[rank]
    if culprit.step_s is None:
        return True
    extra = culprit.own_s - statistics.fmean(w.own_s for r, w in works.items() if r != rank)
    return extra >= th.straggler_extra_share_min * culprit.step_s


def _persistent(rank: int, works: Mapping[int, RankWork]) -> bool:
    """Its window is long enough, and it was slower than its peers through most of it."""
    culprit = works[rank]
    if culprit.steps is not None and culprit.steps < STRAGGLER_MIN_STEPS:
        return False
    low = culprit.own_low_s if culprit.own_low_s is not None else culprit.own_s
    peers_high = statistics.fmean(w.own_high_s if w.own_high_s is not None else w.own_s
                                  for r, w in works.items() if r != rank)
    return low > peers_high


def _cause(rank: int, works: Mapping[int, RankWork], th: Thresholds) -> StragglerCause:
    culprit = works[rank]
    peers = [w for r, w in works.items() if r != rank]
    extra = culprit.own_s - statistics.fmean(w.own_s for w in peers)
    if culprit.data_s is not None and extra > 0:
        peer_data = statistics.fmean(w.data_s or 0.0 for w in peers)
        if culprit.data_s - peer_data >= INPUT_SHARE_MIN * extra:
            return StragglerCause.INPUT
    if culprit.cpu_wait_s is not None and extra > 0:
        peer_wait = statistics.fmean(w.cpu_wait_s or 0.0 for w in peers)
        if culprit.cpu_wait_s - peer_wait >= HOST_SHARE_MIN * extra:
            return StragglerCause.HOST
    clocks = [w.sm_clock_hz for w in peers if w.sm_clock_hz]
    slow_clock = (culprit.sm_clock_hz is not None and bool(clocks)
                  and culprit.sm_clock_hz < th.straggler_clock_ratio_max
                  * statistics.median(clocks))
    # Trouble every GPU of the run shares (a hot room, a power cap) does not make one slow.
    if (culprit.gpu_trouble and not all(w.gpu_trouble for w in peers)) or slow_clock:
        return StragglerCause.GPU
    if culprit.data_s is not None:
        return StragglerCause.COMPUTE
    return StragglerCause.UNKNOWN
