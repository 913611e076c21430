"""The run as the page draws it: time bins of per-rank figures, bounded whatever the run's length.

Every series is kept as sums and counts per time bin (at most ``MAX_BINS`` of them), so a day of
64 ranks takes as much memory as ten minutes of them: a picture has no more points than the page
has pixels across. Both loaders fill the same model.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from gpumon.analysis.goodput import TimeTotals
from gpumon.errors import GpumonError
from gpumon.wire import ParallelLayout

MAX_BINS = 600
"""Time bins across the run: about the width in pixels of a figure on a laptop's screen."""

PHASES = ("data", "forward", "backward", "optimizer", "comm", "other")
"""The stacked phases of a step, bottom to top; ``comm`` is the exposed collective wait."""

MEMORY_COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "other")

GPU_METRICS = (
    ("utilization", "GPU utilisation"), ("sm_active", "SM active"),
    ("tensor_active", "tensor active"), ("dram_active", "DRAM active"),
)
LINK_METRICS = (
    ("nvlink_tx_bytes_per_second", "NVLink tx"), ("nvlink_rx_bytes_per_second", "NVLink rx"),
    ("pcie_tx_bytes_per_second", "PCIe tx"), ("pcie_rx_bytes_per_second", "PCIe rx"),
)


class ReportError(GpumonError):
    """The report cannot be made; the message says why (and, for a run, which runs there are)."""

    exit_code = 1


class Mean:
    """Sums and counts per bin: a mean per bin in bounded memory."""

    __slots__ = ("sums", "counts")

    def __init__(self, bins: int) -> None:
        self.sums = [0.0] * bins
        self.counts = [0] * bins

    def add(self, index: int, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            self.sums[index] += value
            self.counts[index] += 1

    def values(self) -> list[float | None]:
        return [s / c if c else None for s, c in zip(self.sums, self.counts, strict=True)]


class Peak:
    """The largest value per bin (memory: the highest point is what meets the wall)."""

    __slots__ = ("peaks",)

    def __init__(self, bins: int) -> None:
        self.peaks: list[float | None] = [None] * bins

    def add(self, index: int, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            old = self.peaks[index]
            self.peaks[index] = value if old is None else max(old, value)

    def values(self) -> list[float | None]:
        return list(self.peaks)


@dataclass
class Summary:
    """The run's headline numbers, as the page's first table shows them."""

    steps: int = 0
    ranks: int = 0
    seconds: float = 0.0
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    walls: dict[str, float] = field(default_factory=dict)
    """Share of steps per verdict, largest first."""
    top_hint: str | None = None
    stragglers: dict[int, str] = field(default_factory=dict)
    """Rank → its cause, for every rank flagged a straggler."""
    stalls: dict[int, float] = field(default_factory=dict)
    """Rank → the longest time it made no progress (seconds), for ranks that stalled."""
    oom_events: int = 0
    oom_prediction: dict[int, tuple[float, str]] = field(default_factory=dict)
    """Rank → seconds until its peaks reach capacity, and what the OOM risk says."""


@dataclass
class RunModel:
    """A run in time bins. Per-bin lists hold ``None`` where nothing was reported."""

    run: str
    source: str
    start: float
    end: float
    bins: int
    ranks: list[int] = field(default_factory=list)
    summary: Summary = field(default_factory=Summary)
    phases: dict[str, Mean] = field(default_factory=dict)
    """Mean seconds per step of each phase, over every rank's steps ending in the bin."""
    step_time: dict[int, Mean] = field(default_factory=dict)
    verdicts: dict[int, list[Counter[str]]] = field(default_factory=dict)
    """Rank → steps per verdict in each bin."""
    memory_peak: dict[int, Peak] = field(default_factory=dict)
    memory_components: dict[str, Mean] = field(default_factory=dict)
    memory_rank: int | None = None
    """The rank whose breakdown is drawn: the one nearest its capacity."""
    capacity_bytes: float | None = None
    gpu: dict[str, dict[int, Mean]] = field(default_factory=lambda: defaultdict(dict))
    comm_exposed: Mean | None = None
    comm_overlapped: Mean | None = None
    bus_bandwidth: dict[str, Mean] = field(default_factory=dict)
    layouts: dict[int, ParallelLayout] = field(default_factory=dict)
    """Rank → its place in the job's parallelism, for the ranks whose hook told it."""
    own_work_s: dict[int, float] = field(default_factory=dict)
    """Rank → its own work per step (step time less its collective wait), over the run."""
    bubble_share: dict[int, float] = field(default_factory=dict)
    """Rank → the share of its step time it waited to receive from another rank (a pipeline
    stage's bubble), for the ranks that received point to point."""
    bubble: dict[int, Mean] = field(default_factory=dict)
    """Rank → its bubble's share of its steps ending in each bin."""
    moe_ratio: dict[str, Peak] = field(default_factory=dict)
    """MoE layer → its busiest expert over the mean (over its ranks' last steps), the worst rank
    in each bin; empty for a run without MoE layers."""
    all_to_all: dict[int, Mean] = field(default_factory=dict)
    """Rank → seconds per step its all-to-alls were in flight, for the ranks that issued any."""
    time_totals: dict[int, TimeTotals] = field(default_factory=dict)
    """Rank → where its time went, the agent's latest figures (goodput, unsaved, badput by
    cause; ``restarted_at`` in unix time); empty where the source has none (a recording made
    before the agent accounted time), and the page then says nothing of goodput."""
    notes: list[str] = field(default_factory=list)
    """What the page must say about its own limits (lines skipped, series missing)."""

    def __post_init__(self) -> None:
        self.width_s = max(self.end - self.start, 1e-9) / self.bins

    def index(self, t: float) -> int:
        """The bin of unix time ``t`` (clamped into the run)."""
        return min(self.bins - 1, max(0, int((t - self.start) / self.width_s)))

    def times(self) -> list[float]:
        """Bin centres, in seconds from the run's start."""
        return [(i + 0.5) * self.width_s for i in range(self.bins)]

    def mean(self, table: dict[Any, Mean], key: Any) -> Mean:
        """``table[key]``, made empty the first time."""
        if key not in table:
            table[key] = Mean(self.bins)
        return table[key]

    def peak(self, table: dict[Any, Peak], key: Any) -> Peak:
        """``table[key]``, made empty the first time."""
        if key not in table:
            table[key] = Peak(self.bins)
        return table[key]

    def rank_verdicts(self, rank: int) -> list[Counter[str]]:
        """The rank's verdict counts per bin, made empty the first time."""
        if rank not in self.verdicts:
            self.verdicts[rank] = [Counter() for _ in range(self.bins)]
        return self.verdicts[rank]


def splits_model(model: RunModel) -> bool:
    """Whether the run's ranks report a layout or receive from one another: the page then shows
    each rank's place, own work and bubble."""
    return bool(model.layouts or model.bubble_share)


def stage_own_work(model: RunModel) -> dict[int, float]:
    """Each pipeline stage's own work per step: the mean over its ranks whose stage is known."""
    by_stage: dict[int, list[float]] = defaultdict(list)
    for rank, layout in model.layouts.items():
        if layout.pp is not None and rank in model.own_work_s:
            by_stage[layout.pp].append(model.own_work_s[rank])
    return {stage: sum(own) / len(own) for stage, own in sorted(by_stage.items())}


def slowest_stage(model: RunModel) -> tuple[int, float, float] | None:
    """The stage that holds a pipeline of two stages or more back: the one with the most own
    work per step (the others wait for it in their bubble), that work, and its ratio to the
    stages' mean (1 balanced; GpumonPipelineImbalance fires from 1.25)."""
    stages = stage_own_work(model)
    mean = sum(stages.values()) / len(stages) if stages else 0.0
    if len(stages) < 2 or mean <= 0:
        return None
    stage = max(stages, key=lambda s: (stages[s], -s))
    return stage, stages[stage], stages[stage] / mean


def bin_count(start: float, end: float, resolution_s: float) -> int:
    """Bins for a run from ``start`` to ``end``: no finer than its data, at most ``MAX_BINS``."""
    return max(1, min(MAX_BINS, math.ceil((end - start) / max(resolution_s, 1e-3))))


def dominant(counts: Counter[str]) -> str | None:
    """The verdict most of a bin's steps had (ties: the alphabetically first, for stability)."""
    if not counts:
        return None
    return min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]
