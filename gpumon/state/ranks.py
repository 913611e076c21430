"""The rank store: one record per (run, rank), fed by the ingest socket and read by scrapes.

A record holds what ingest counted for the rank (its totals) and the analyzer's working state
for it (``analysis.stream.RankTracker``), so the rank expires, is evicted or makes way for
another job's process in one place, and a scrape reads one list: each rank's totals with the
analysis it carried when copied.

Bounded, and fair between the users and the processes that send: a (run, rank) that stops
reporting expires after a TTL, and a cap on live pairs bounds the number of series. When
the cap is reached, a user holding less than its share of it, or a process holding less
than its share of its user's pairs, still gets in by evicting the least recently reporting
pair of the biggest holder; a sender at its share may replace only its user's pairs that
have gone quiet; otherwise its new pair is rejected, the reason naming the rule
(``gpumon.collectors.sender_shares``). So one process flooding fake pairs, or a sweep of
many short runs, never locks out the next job, even of the same uid.

A (run, rank) belongs to the uid that first reported it until it expires: records for it
from another uid are dropped (``not_owner``), so a member of the socket's group cannot
forge another user's OOMs, steps or process. Values that would break a counter or a
timestamp for good (a step ending far from the agent's clock, absurd FLOP or token counts)
are dropped with their own reasons. A second live process claiming a pair of the same uid is
another job under the same name, watched apart (``rank_conflicts``).
"""

from __future__ import annotations

import itertools
import threading
from bisect import bisect_left
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from gpumon.analysis.comm import wait_s
from gpumon.analysis.goodput import TimeLedger, TimeTotals
from gpumon.analysis.stream import RankAnalysis, RankKey, RankTracker, new_tracker
from gpumon.collectors.samples import SenderCredentials
from gpumon.collectors.sender_shares import SenderShares
from gpumon.state.collectives import CommTotals
from gpumon.state.rank_conflicts import RankClaims, sender_process
from gpumon.state.rank_time import FINISHED_EVENT, account_process, account_state, preserve_run
from gpumon.wire import (
    KNOWN_PHASES,
    EventRecord,
    HelloRecord,
    MemoryBreakdown,
    MoeStats,
    ParallelLayout,
    Record,
    SpanRecord,
    StateRecord,
    StepRecord,
)

# Step-duration histogram buckets (seconds): from fast fine-tuning steps to slow
# large-model steps; le="+Inf" is added on export.
DURATION_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

IDLE_EVICT_S = 60.0
"""A pair silent this long may give its place to a new pair of the same sender."""
MAX_CLOCK_SKEW_S = 300.0
"""How far a step's end may be from the agent's clock. Client and agent read the same
node clock and a step is sent as it ends, so more is a forgery or a stuck sender; such a
step would hold gpumon_step_last_timestamp_seconds in the future (no stall alert)."""
MAX_FLOPS_PER_S = 1e19
"""Per rank: ~10,000 of today's fastest GPUs (even a client reporting its whole job's
FLOPs on every rank stays below). One 1e30 would freeze the float counter for good."""
MAX_ITEMS_PER_S = 1e10
"""Samples or tokens per second and rank; beyond 2**53 a counter stops counting."""
RATE_FLOOR_S = 1e-3
"""A step shorter than this is judged as if it took this long."""
_KNOWN_PHASES = frozenset(KNOWN_PHASES)
# Process-wide, so that no two states of a (run, rank), even across an expiry or two stores,
# ever carry the same version: a renderer may reuse its text for a version it has seen.
_versions = itertools.count(1)


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


class RankStore:
    """Thread-safe map of (run, rank) to RankTotals with TTL expiry and a fair cap; the
    analyzer's ``Trackers`` (``analysis.stream``), which go with their records.

    ``alive(pid)`` says whether a process the agent sees still runs, to tell a second job's
    claim on a pair from a restart; without it every new process is a restart.

    Its lock guards which records there are and what ingest writes in them; an analyzer calls
    ``tracker`` and ``trackers`` holding its own lock, never the other way round."""

    def __init__(self, ttl_s: float = 300.0, max_ranks: int = 1024,
                 alive: Callable[[int], bool] | None = None,
                 started: Callable[[int], float | None] | None = None) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[RankKey, RankTotals] = {}
        # Least recently reporting first: all pairs (each sender's own: in the shares).
        self._recent: OrderedDict[RankKey, None] = OrderedDict()
        self._shares: SenderShares[RankKey] = SenderShares(max_ranks, IDLE_EVICT_S)
        self._gone: list[RankKey] = []  # removed while ingesting, for the next expire()
        self.ttl_s = ttl_s
        self.max_ranks = max_ranks
        self.records_total: Counter[str] = Counter()  # by kind
        self.dropped_total: Counter[str] = Counter()  # by reason
        self.evicted_total: Counter[str] = Counter()  # pairs evicted to make room, by reason
        self._claims = RankClaims(max_ranks, alive)
        self._started = started

    def ingest(self, records: list[Record], sender: SenderCredentials, monotonic: float,
               now_t: float, ended: bool = False) -> list[StepRecord]:
        """Apply decoded records; returns the steps accepted (for recording/verdicts).

        ``ended``: the records of ``sender``, a process that has ended, read from its step
        ring (``collectors/rings.py``): they are its rank's whoever sends for it now (a
        restart already running is no second job), and say nothing of which process that is."""
        accepted: list[StepRecord] = []
        with self._lock:
            for record in records:
                key = (record.run, record.rank)
                state = self._ranks.get(key)
                if state is not None and state.uid != sender.uid:
                    self.dropped_total["not_owner"] += 1
                    continue
                reason = implausible(record, now_t)
                if reason is not None:
                    self.dropped_total[reason] += 1
                    continue
                if state is not None and not ended:
                    clash, state.earlier_pids = self._claims.route(
                        key, state.kernel_pid, state.pid, state.exited_monotonic is not None,
                        state.earlier_pids, sender_process(sender, record))
                    if clash is not None:  # another job's process: watched under its own run
                        record, key, state = replace(record, run=clash[0]), clash, \
                            self._ranks.get(clash)
                        if state is not None and state.uid != sender.uid:
                            self.dropped_total["not_owner"] += 1
                            continue
                if state is None:
                    state = self._admit(key, sender, monotonic)
                    if state is None:
                        continue
                else:
                    self._shares.touch(key, (sender.uid, sender.pid))
                state.last_seen_monotonic = monotonic
                self._recent.move_to_end(key)
                # The kernel's word for which process this is; the record's only without it.
                pid = sender.pid if sender.pid is not None else record.pid
                if ended:
                    pid = None
                if pid is not None:
                    state.pid = pid
                if sender.pid is not None and sender.pid != state.kernel_pid and not ended:
                    state.kernel_pid = sender.pid  # a new process of this rank (a restart)
                    state.exited_monotonic = None
                state.ledger = account_process(state.ledger, pid, sender.pid is not None,
                                               self._started, monotonic)
                if isinstance(record, StateRecord):
                    # Rendered at each scrape from the report: the step series stay as they are.
                    self.records_total["state"] += 1
                    state.report, state.report_monotonic = record, monotonic
                    account_state(state.ledger, record.state, state.last_step_monotonic,
                                  monotonic)
                    continue
                if isinstance(record, StepRecord):
                    self.records_total["step"] += 1
                    _note_identity(state, record.world, record.local_rank, record.gpu)
                    latest = state.last_step, state.last_step_end_t, state.last_duration_s
                    state.add_step(record, now_t)
                    ledger_of(state).step(record.duration_s, monotonic)
                    if not ended:
                        state.last_step_monotonic = monotonic
                    elif latest[1] is not None and (state.last_step_end_t or 0.0) < latest[1]:
                        # a successor's newer step stays the rank's latest
                        state.last_step, state.last_step_end_t, state.last_duration_s = latest
                    accepted.append(record)
                elif isinstance(record, SpanRecord):
                    self.records_total["span"] += 1
                    covered = ledger_of(state).span(record.span, record.seconds, record.ok,
                                                    record.steps, monotonic)
                    if covered is not None:
                        preserve_run(((k, s.ledger) for k, s in self._ranks.items()),
                                     record.run, record.rank, covered)
                elif isinstance(record, EventRecord):
                    self.records_total["event"] += 1
                    if record.event == "oom":
                        state.oom_events_total += 1
                    elif record.event == FINISHED_EVENT:
                        ledger_of(state).finished(monotonic)
                    _note_identity(state, None, None, record.gpu)
                elif isinstance(record, HelloRecord):
                    self.records_total["hello"] += 1
                    _note_identity(state, record.world, record.local_rank, record.gpu)
                    if record.framework is not None:
                        state.framework, state.zero_stage = record.framework, record.zero_stage
                    if record.parallel is not None:
                        state.parallel = record.parallel
                state.version = next(_versions)
        return accepted

    def count_dropped(self, reason: str, count: int = 1) -> None:
        """Count records dropped before they reached the store (decode, auth, ...)."""
        with self._lock:
            self.dropped_total[reason] += count

    def _admit(self, key: RankKey, sender: SenderCredentials,
               monotonic: float) -> RankTotals | None:
        """A new pair of ``sender``, making room under the cap if it fairly can (else the
        refusal is counted and None returned)."""
        if len(self._ranks) >= self.max_ranks:
            self._gone += self._expire_locked(monotonic)
        holder = (sender.uid, sender.pid)
        if len(self._ranks) >= self.max_ranks:
            self._shares.max_pairs = self.max_ranks
            evicted, reason = self._shares.make_room(
                holder, monotonic, lambda k: self._ranks[k].last_seen_monotonic)
            if evicted is None:
                self.dropped_total[reason] += 1
                return None
            self._forget(evicted)
            self._gone.append(evicted)
            self.evicted_total[reason] += 1
        state = self._ranks[key] = RankTotals(run=key[0], rank=key[1],
                                             last_seen_monotonic=monotonic, uid=sender.uid)
        self._recent[key] = None
        self._shares.add(key, holder)
        return state

    def _forget(self, key: RankKey) -> None:
        del self._ranks[key]
        del self._recent[key]
        self._shares.remove(key)
        self._claims.forget(key)

    def expire(self, monotonic: float) -> list[RankKey]:
        """Forget ranks silent for longer than the TTL; returns which went (also those
        expired or evicted since the last call, while making room)."""
        with self._lock:
            gone, self._gone = self._gone + self._expire_locked(monotonic), []
            return gone

    def _expire_locked(self, monotonic: float) -> list[RankKey]:
        stale = []
        for key in self._recent:  # least recently reporting first: stop at the first live
            if monotonic - self._ranks[key].last_seen_monotonic <= self.ttl_s:
                break
            stale.append(key)
        for key in stale:
            self._forget(key)
        return stale

    def ranks(self) -> list[RankTotals]:
        """Copies of every live rank's state (without step history) and its analysis, for
        rendering."""
        with self._lock:
            return [_copy(s) for s in self._ranks.values()]

    def tracker(self, key: RankKey) -> RankTracker | None:
        """The analyzer's state for a live rank, made at its first step; None once it has gone."""
        with self._lock:
            state = self._ranks.get(key)
            if state is None:
                return None
            if state.tracker is None:
                state.tracker = new_tracker(key)
            return state.tracker

    def trackers(self) -> list[RankTracker]:
        """The analyzer's state for every live rank that has any."""
        with self._lock:
            return [s.tracker for s in self._ranks.values() if s.tracker is not None]

    def counters(self) -> tuple[dict[str, int], dict[str, int]]:
        """(records by kind, dropped by reason)."""
        with self._lock:
            return dict(self.records_total), dict(self.dropped_total)

    def evictions(self) -> dict[str, int]:
        """Pairs evicted to make room under the cap, by reason."""
        with self._lock:
            return dict(self.evicted_total)

    def conflicts(self) -> dict[RankKey, int]:
        """Live pairs a second live process claimed, and how often (``rank_conflicts``)."""
        with self._lock:
            return dict(self._claims.conflicts_total)

    def watched_pids(self) -> dict[int, list[RankKey]]:
        """pid (as the kernel gave it) -> the ranks it sends for, of every rank not seen to
        have exited."""
        with self._lock:
            pids: dict[int, list[RankKey]] = {}
            for key, s in self._ranks.items():
                if s.kernel_pid is not None and s.exited_monotonic is None:
                    pids.setdefault(s.kernel_pid, []).append(key)
            return pids

    def exited_pids(self) -> set[int]:
        """The pids (as the kernel gave them) of ranks seen to have exited, kept until they
        expire."""
        with self._lock:
            return {s.kernel_pid for s in self._ranks.values()
                    if s.kernel_pid is not None and s.exited_monotonic is not None}

    def mark_exited(self, pids: set[int], monotonic: float,
                    exits: Mapping[int, float] | None = None) -> None:
        """The processes ``pids`` ended (at ``exits[pid]`` where known, else by ``monotonic``):
        their ranks are ``exited`` (kept until they expire)."""
        with self._lock:
            for s in self._ranks.values():
                if s.kernel_pid in pids and s.exited_monotonic is None:
                    s.exited_monotonic = monotonic
                    if s.ledger is not None and s.ledger.pid == s.kernel_pid:
                        s.ledger.ended((exits or {}).get(s.kernel_pid, monotonic))
                    s.version = next(_versions)

    def time_totals(self, monotonic: float) -> dict[RankKey, TimeTotals]:
        """(run, rank) -> where its time went as of ``monotonic``, of every rank that has any."""
        with self._lock:
            return {k: s.ledger.totals(monotonic) for k, s in self._ranks.items()
                    if s.ledger is not None}

    def layouts(self) -> dict[RankKey, ParallelLayout]:
        """(run, rank) -> its place in its job's parallelism, of every rank whose hello said."""
        with self._lock:
            return {k: s.parallel for k, s in self._ranks.items() if s.parallel is not None}

    def pids(self) -> dict[int, RankKey]:
        """pid -> (run, rank) of every live rank whose pid is known."""
        with self._lock:
            return {s.pid: k for k, s in self._ranks.items() if s.pid is not None}


def implausible(record: Record, now_t: float) -> str | None:
    """Why a step's values would break a counter or a timestamp for good, or None."""
    if not isinstance(record, StepRecord):
        return None
    end_t = record.t_end
    if end_t is not None and abs(end_t - now_t) > MAX_CLOCK_SKEW_S:
        return "clock_skew"
    window_s = max(record.duration_s, RATE_FLOOR_S)
    if record.flops is not None and record.flops > MAX_FLOPS_PER_S * window_s:
        return "implausible_flops"
    if max(record.tokens or 0, record.samples or 0) > MAX_ITEMS_PER_S * window_s:
        return "implausible_count"
    return None


def ledger_of(state: RankTotals) -> TimeLedger:
    """The rank's ledger, made at its first use."""
    if state.ledger is None:
        state.ledger = TimeLedger()
    return state.ledger


def _note_identity(state: RankTotals, world: int | None, local_rank: int | None,
                   gpu: str | int | None) -> None:
    if world is not None:
        state.world = world
    if local_rank is not None:
        state.local_rank = local_rank
    if gpu is not None:
        state.gpu_hint = gpu


def _copy(state: RankTotals) -> RankTotals:
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
