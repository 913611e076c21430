"""The record the rank store keeps for one (run, rank): its identity, the totals ingest counted
for it, its latest readings, the analyzer's and the time ledger's state for it, and how a scrape
copies it (``state/ranks.py`` holds the records)."""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field

from gpumon.analysis.comm import wait_s
from gpumon.analysis.goodput import TimeLedger
from gpumon.analysis.stream import RankAnalysis, RankTracker
from gpumon.state.collectives import CommTotals
from gpumon.wire import KNOWN_PHASES, MemoryBreakdown, MoeStats, ParallelLayout, StateRecord, StepRecord

# Step-duration histogram buckets (seconds): from fast fine-tuning steps to slow
# large-model steps; le="+Inf" is added on export.
DURATION_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

_KNOWN_PHASES = frozenset(KNOWN_PHASES)
# Process-wide, so that no two states of a (run, rank), even across an expiry or two stores,
# ever carry the same version: a renderer may reuse its text for a version it has seen.
_versions = itertools.count(1)


def next_version() -> int:
    """A version no state of any rank has carried."""
    return next(_versions)


@dataclass
class RankTotals:
    """The record of one rank of one run: what ingest has counted for it (its identity,
    running totals and latest readings) and the analyzer's state for it."""

    run: str
    rank: int
    last_seen_monotonic: float
    world: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    uid: int | None = None
    gpu_hint: str | int | None = None
    steps_total: int = 0
    phase_seconds_total: defaultdict[str, float] = field(
        default_factory=lambda: defaultdict(float))
    samples_total: int = 0
    tokens_total: int = 0
    flops_total: float = 0.0
    duration_bucket_counts: list[int] = field(
        default_factory=lambda: [0] * (len(DURATION_BUCKETS_S) + 1))
    duration_sum_s: float = 0.0
    last_step: int | None = None
    last_step_end_t: float | None = None
    last_duration_s: float | None = None
    memory_allocated_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    memory_peak_bytes: int | None = None
    alloc_retries_total: int | None = None
    torch_ooms_reported: int = 0
    oom_events_total: int = 0
    comm: CommTotals | None = None
    """Collective communication, once a step has reported any (measured or a comm phase)."""
    memory_breakdown: MemoryBreakdown | None = None
    """The latest sampled breakdown (``watch(model, optimizer)``)."""
    moe: MoeStats | None = None
    """The latest expert load of the rank's MoE layers, over its client's window of steps."""
    kernel_pid: int | None = None
    """The sender's pid as the kernel gave it (SCM_CREDENTIALS): a process the agent can see."""
    report: StateRecord | None = None
    """The hook's latest word on its progress, and its place while stalled."""
    report_monotonic: float | None = None
    last_step_monotonic: float | None = None
    exited_monotonic: float | None = None
    """When the agent saw the process end (``None``: alive, or not seen)."""
    earlier_pids: tuple[int, ...] = ()
    """Reported pids this rank's process replaced where the kernel gave none (``rank_conflicts``)."""
    framework: str | None = None
    """What drives the rank's loop, as its hello said (``deepspeed``)."""
    zero_stage: int | None = None
    """The ZeRO stage it runs, as its hello said."""
    parallel: ParallelLayout | None = None
    """Its place in the job's parallelism, as its latest hello said (``None``: not known)."""
    ledger: TimeLedger | None = field(default=None, compare=False, repr=False)
    """In the store: where the rank's time went (``analysis.goodput``), from its first record
    on. None in a copy (``RankStore.time_totals`` reads it)."""
    version: int = field(default_factory=lambda: next(_versions), compare=False)
    """Changes whenever anything above does (RankStore stamps it)."""
    tracker: RankTracker | None = field(default=None, compare=False, repr=False)
    """In the store: the analyzer's state for the rank, from its first step on
    (``RankStore.tracker``); it goes with the record. The analyzer's lock guards what is in
    it. None in a copy."""
    analysis: RankAnalysis | None = field(default=None, compare=False)
    """In a copy (``RankStore.ranks``): what the analyzer said of the rank when it was taken,
    if it has said anything (its ``version`` is its own)."""

    @property
    def ooms_total(self) -> int:
        """OOMs: torch's own cumulative count, or escaped-OOM events if more were seen."""
        return max(self.torch_ooms_reported, self.oom_events_total)

    def add_step(self, record: StepRecord, now_t: float) -> None:
        """Fold one step into the counters."""
        self.steps_total += 1
        for phase, seconds in record.phases_s.items():
            self.phase_seconds_total[phase if phase in _KNOWN_PHASES else "other"] += seconds
        self.samples_total += record.samples or 0
        self.tokens_total += record.tokens or 0
        self.flops_total += record.flops or 0.0
        self.duration_bucket_counts[bisect_left(DURATION_BUCKETS_S, record.duration_s)] += 1
        self.duration_sum_s += record.duration_s
        self.last_step = record.step
        end_t = record.t_end
        self.last_step_end_t = end_t if end_t is not None else now_t
        self.last_duration_s = record.duration_s
        mem = record.mem
        if mem is not None:
            if mem.allocated_bytes is not None:
                self.memory_allocated_bytes = mem.allocated_bytes
            if mem.reserved_bytes is not None:
                self.memory_reserved_bytes = mem.reserved_bytes
            if mem.peak_bytes is not None:
                self.memory_peak_bytes = mem.peak_bytes
            if mem.alloc_retries is not None:
                self.alloc_retries_total = mem.alloc_retries
            if mem.ooms is not None:
                self.torch_ooms_reported = max(self.torch_ooms_reported, mem.ooms)
        if record.memory_breakdown is not None:
            self.memory_breakdown = record.memory_breakdown
        if record.moe is not None:
            self.moe = record.moe
        if wait_s(record) is not None:
            if self.comm is None:
                self.comm = CommTotals()
            self.comm.add(record)



def ledger_of(state: RankTotals) -> TimeLedger:
    """The rank's ledger, made at its first use."""
    if state.ledger is None:
        state.ledger = TimeLedger()
    return state.ledger


def note_identity(state: RankTotals, world: int | None, local_rank: int | None,
                  gpu: str | int | None) -> None:
    """What a record says of the rank's place (its world, local rank, GPU), where it says."""
    if world is not None:
        state.world = world
    if local_rank is not None:
        state.local_rank = local_rank
    if gpu is not None:
        state.gpu_hint = gpu


def copy_totals(state: RankTotals) -> RankTotals:
    """A copy for a scrape: its own counters, the analysis it carried, no ledger."""
    # Taken under the store's lock, which ingest waits on: the attributes as they are (a
    # quarter of what building one through __init__ costs), then the mutable ones copied.
    clone = object.__new__(RankTotals)
    clone.__dict__.update(state.__dict__)
    clone.phase_seconds_total = defaultdict(float, state.phase_seconds_total)
    clone.duration_bucket_counts = list(state.duration_bucket_counts)
    clone.comm = state.comm.copy() if state.comm is not None else None
    # Published analyses are never changed: taken as they are, without the analyzer's lock.
    clone.tracker, clone.analysis = None, state.tracker.analysis if state.tracker else None
    clone.ledger = None
    return clone
