"""Each rank's state in the streaming verdict engine (``stream.StepAnalyzer``), in three parts
that the data flows through one way: what it received (``Received``, written by ``add``), what
its analysed windows leave for the next (``Analysed``), and what the analyzer concluded
(``RankAnalysis``, published and never changed: a new one replaces it). ``RankTracker`` holds
the three for one rank; ``Trackers`` is where the analyzer keeps them.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Protocol

from gpumon.analysis.bottleneck import Verdict
from gpumon.analysis.memory import MemoryAttribution
from gpumon.analysis.oom import OomRisk
from gpumon.analysis.straggler import SlowerRank, Standing, StragglerCause, own_work_s
from gpumon.wire import MemoryBreakdown, ParallelLayout, StepRecord

__all__ = ["Analysed", "RankAnalysis", "RankKey", "RankTracker", "Received", "TrackerTable",
           "Trackers", "new_tracker", "new_version", "renewed"]

RankKey = tuple[str, int]
"""(run, rank): how a rank of a run is named everywhere in the agent."""

WORK_HISTORY = 24  # steps per rank for the straggler comparison (its medians and quartiles)
COMM_HISTORY = 8  # windows per rank whose median communication share bounds one window's
PEAK_HISTORY = 64  # per-step peaks per rank for the OOM trend
BREAKDOWN_HISTORY = 16  # sampled memory breakdowns per rank: ~80 s at the client's 5 s
# Process-wide, so that no two analyses of a (run, rank), even across a forget or two
# analyzers, ever carry the same version: a renderer may reuse its text for a version it has seen.
_versions = itertools.count(1)


def new_version() -> int:
    """A version no analysis has carried."""
    return next(_versions)


@dataclass(frozen=True)
class RankAnalysis:
    """What the analyzer currently says about one rank. One handed out is never changed: the
    analyzer replaces it (``RankTracker.conclude``), so a reader on another thread may take it
    without the analyzer's lock."""

    run: str
    rank: int
    gpu: int | None = None
    verdict: Verdict | None = None
    verdict_step: int | None = None
    bottleneck_steps: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Steps analysed so far, by the wall of their verdict."""
    oom: OomRisk | None = None
    straggler_score: float | None = None
    """Its peers' mean own work per step ÷ its own (``straggler.straggler_scores``)."""
    straggler_cause: StragglerCause | None = None
    """Set while it is its run's straggler."""
    slower_rank: SlowerRank | None = None
    """Set while another rank of its run is the straggler, or went silent."""
    world_changes: int = 0
    """Times the world size this rank reports changed (its comparison history restarts)."""
    memory: MemoryAttribution | None = None
    """Which memory component the rank's sampled breakdowns blame, when it sends them."""
    step_period_s: float | None = None
    """Median time per step over its latest analysed windows."""
    own_work_s: float | None = None
    """Median own work per step (step time less collective wait) in the latest comparison."""
    parallel: ParallelLayout | None = None
    """Its place in the job's parallelism in the latest comparison: it was compared with its
    data-parallel replicas. ``None``: not known, it was compared with every rank of its run
    whose layout was not known either."""
    sm_clock_hz: float | None = None
    """Mean SM clock of its GPU over its latest verdict's window."""
    gpu_trouble: bool = False
    """Its GPU throttled over its latest verdict's window, or has reported XID errors."""
    version: int = field(default_factory=lambda: new_version(), compare=False)
    """Changes whenever anything above does."""

    @property
    def standing(self) -> Standing:
        """What the latest comparison with its peers said."""
        return Standing(self.straggler_score, self.straggler_cause, self.slower_rank)


_ANALYSIS_FIELDS = frozenset(f.name for f in fields(RankAnalysis))
assert all(f.init for f in fields(RankAnalysis)) and not hasattr(RankAnalysis, "__post_init__") \
    and not hasattr(RankAnalysis, "__slots__"), "renewed copies the fields' values only"


def renewed(analysis: RankAnalysis, **changes: Any) -> RankAnalysis:
    """``dataclasses.replace(analysis, **changes)``: the same new analysis, made by copying the
    fields' values rather than by calling ``__init__`` with every field by keyword (a quarter
    of a million a day's report; ``RankAnalysis`` sets its fields and does nothing else)."""
    if type(analysis) is not RankAnalysis or not _ANALYSIS_FIELDS.issuperset(changes):
        return replace(analysis, **changes)  # a subclass; or its error, for no field's name
    made = object.__new__(RankAnalysis)
    values = made.__dict__
    values.update(analysis.__dict__)
    values.update(changes)
    return made


@dataclass
class Received:
    """A rank's steps as they arrive: written by ``StepAnalyzer.add`` only. The comparison
    reads the figures of its latest steps; a pass takes the pending steps it analyses."""

    pending: list[StepRecord] = field(default_factory=list)
    own_s: deque[float] = field(default_factory=lambda: deque(maxlen=WORK_HISTORY))
    """Own work of its latest steps."""
    data_s: deque[float | None] = field(default_factory=lambda: deque(maxlen=WORK_HISTORY))
    cpu_wait_s: deque[float | None] = field(default_factory=lambda: deque(maxlen=WORK_HISTORY))
    step_s: deque[float] = field(default_factory=lambda: deque(maxlen=WORK_HISTORY))
    """Durations of its latest steps: the share of the step a straggler costs."""
    breakdowns: deque[tuple[float, MemoryBreakdown]] = field(
        default_factory=lambda: deque(maxlen=BREAKDOWN_HISTORY))
    last_pid: int | None = None
    world: int | None = None
    last_end_t: float = -math.inf
    """When its newest step (analysed or waiting) ended."""

    def take(self, step: StepRecord) -> None:
        """Note one step's figures for the comparison, and queue it for analysis."""
        self.own_s.append(own_work_s(step))
        self.data_s.append(step.phases_s.get("data", 0.0) if step.phases_s else None)
        self.cpu_wait_s.append(step.cpu_wait_s)
        self.step_s.append(step.duration_s)
        self.pending.append(step)

    def restart(self) -> None:
        """Forget the comparison's figures: they describe a run that no longer exists."""
        self.own_s.clear()
        self.data_s.clear()
        self.cpu_wait_s.clear()
        self.step_s.clear()


@dataclass
class Analysed:
    """What a rank's analysed windows leave for its next ones: written by its analysis only."""

    last: StepRecord | None = None
    """The newest step analysed: allocator counters rising since it signal pressure."""
    device_shares: dict[str, float] | None = None
    """Phase shares of its latest GPU-timed steps (``device_timing``), for windows without any."""
    comm_shares: deque[float] = field(default_factory=lambda: deque(maxlen=COMM_HISTORY))
    """Communication shares of its latest windows (``StepEvidence.recent_comm``)."""
    peaks: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=PEAK_HISTORY))
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=WORK_HISTORY))
    """Time per step of its latest windows."""


@dataclass
class RankTracker:
    """The analyzer's state for one rank. The data flows one way: ``add`` writes what was
    received; a pass compares the run's ranks from what they received and concluded last,
    then analyses each rank's pending steps with that comparison and its own window history,
    and publishes the result as ``analysis``. Only the analyzer reads or changes it, under
    its caller's lock, except ``analysis``, which is replaced, never changed."""

    analysis: RankAnalysis
    received: Received = field(default_factory=Received)
    analysed: Analysed = field(default_factory=Analysed)

    def conclude(self, **changes: Any) -> None:
        """Replace ``analysis`` by one with ``changes`` and a new version."""
        self.analysis = renewed(self.analysis, **changes, version=new_version())


class Trackers(Protocol):
    """Where the analyzer keeps its ``RankTracker``s: the agent's rank store (one record per
    rank, which drops the tracker with the rank), or a ``TrackerTable``."""

    def tracker(self, key: RankKey) -> RankTracker | None:
        """The rank's tracker, made at its first step; None for a rank no longer held (its
        steps are dropped)."""
        ...

    def trackers(self) -> list[RankTracker]:
        """Every held rank's tracker."""
        ...


class TrackerTable:
    """Trackers of their own, for an analyzer nothing else holds ranks for (a replay): kept
    as long as the analyzer."""

    def __init__(self) -> None:
        self._trackers: dict[RankKey, RankTracker] = {}

    def tracker(self, key: RankKey) -> RankTracker:
        """The rank's tracker, made at its first step."""
        tracker = self._trackers.get(key)
        if tracker is None:
            tracker = self._trackers[key] = new_tracker(key)
        return tracker

    def trackers(self) -> list[RankTracker]:
        """Every rank's tracker."""
        return list(self._trackers.values())


def new_tracker(key: RankKey) -> RankTracker:
    """A rank's tracker before its first step."""
    return RankTracker(RankAnalysis(*key))
