"""What the agent shows: Prometheus families at scrape time, readiness, the JSON snapshot.

Each view reads copies (a node snapshot, rank-store copies, each with its rank's analysis) and
renders outside every lock. The JSON snapshot is what ``/api/v1/snapshot`` serves and what
``gpumon top`` and ``gpumon demo`` read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import Any

from prometheus_client.core import Metric

from gpumon import __version__
from gpumon.analysis.stall import RankCondition, waits_on_label
from gpumon.analysis.stream import RankAnalysis
from gpumon.collectors.ingest import IngestStatus
from gpumon.collectors.pollers import TIMEOUT_ERROR as NVML_TIMEOUT
from gpumon.collectors.samples import GpuSample, HostSample
from gpumon.export.goodput_metrics import GoodputFamilies, goodput_families
from gpumon.export.gpu_metrics import node_families
from gpumon.export.health_metrics import (
    conflict_families,
    eviction_families,
    ingest_families,
    recording_families,
)
from gpumon.export.memory_metrics import MemoryFamilies
from gpumon.export.moe_metrics import MoeFamilies
from gpumon.export.owner_metrics import owner_families
from gpumon.export.rank_state_metrics import RankStateFamilies, rank_state_families
from gpumon.export.step_metrics import StepFamilies
from gpumon.state.node import NodeSnapshot, NodeState
from gpumon.state.owners import Ownership, OwnerState
from gpumon.state.rank_states import rank_conditions
from gpumon.state.rank_totals import RankTotals
from gpumon.state.ranks import RankStore
from gpumon.state.recording import RecorderStatus
from gpumon.wire import PARALLEL_DIMS, ParallelLayout

STUCK_AFTER_INTERVALS = 3
RENDER_LEAD_S = 0.1
"""Rendering ahead aims this long before the scrape expected next (``render_wait_s``): time for
a pass (5 ms at 64 ranks) and the scraper's jitter, and short beside the ranks' steps, since a
change after the pass is rendered by the scrape itself."""
RENDER_AHEAD_WITHIN_S = 600.0
"""Ranks are rendered ahead only while /metrics was scraped this recently: an agent nobody
scrapes (or one whose scraper went away) does not spend the CPU."""


class AgentCollector:
    """prometheus-client Collector: families are rendered from a snapshot at scrape time."""

    def __init__(self, node: NodeState, rank_store: RankStore,
                 recording: Callable[[], RecorderStatus | None],
                 ingest: Callable[[], IngestStatus | None], owners: OwnerState,
                 unsaved_alert_s: Callable[[], float] = lambda: 3600.0) -> None:
        self._node = node
        self._unsaved_alert_s = unsaved_alert_s
        self._owners = owners
        self._recording = recording
        self._ingest = ingest
        self._rank_store = rank_store
        self._step_families = StepFamilies()  # keeps each run's series rendered
        self._memory_families = MemoryFamilies()
        self._moe_families = MoeFamilies()
        self._rank_state_families = RankStateFamilies()
        self._goodput_families = GoodputFamilies()
        self._scraped_at: float | None = None  # monotonic time of the last collect()
        self._scrape_gap_s: float | None = None  # between the last two

    def collect(self) -> Iterator[Metric]:
        """Every metric family, rendered from one snapshot."""
        now = time.monotonic()
        if self._scraped_at is not None:
            self._scrape_gap_s = now - self._scraped_at
        self._scraped_at = now
        return self._families(scrape=True)

    def render_wait_s(self) -> float:
        """How long rendering ahead waits after a change: until ``RENDER_LEAD_S`` before the
        scrape expected next, one gap between the last two scrapes after the last (or a whole
        number of gaps, where one was missed). None expected yet, or scrapes back to back: no
        wait."""
        scraped, gap = self._scraped_at, self._scrape_gap_s
        if scraped is None or not gap:
            return 0.0
        now = time.monotonic()
        gaps = max(1, math.ceil((now - scraped) / gap))
        return max(0.0, scraped + gaps * gap - RENDER_LEAD_S - now)

    def render_ranks(self) -> None:
        """Render the ranks' series into their caches, as a scrape now would, and drop them:
        the next scrape finds the runs that moved already rendered (``RenderAhead``). Nothing
        unless a scrape came within ``RENDER_AHEAD_WITHIN_S``."""
        scraped = self._scraped_at
        if scraped is None or time.monotonic() - scraped > RENDER_AHEAD_WITHIN_S:
            return
        for _ in self._families(scrape=False):
            pass

    def _families(self, scrape: bool) -> Iterator[Metric]:
        """The scrape's families; without ``scrape``, only those kept rendered per run (the
        rest are not made), and nothing at all without ranks."""
        early = None if scrape else self._rank_store.ranks()
        if early == []:
            return
        snap = self._node.snapshot(time.time())
        if scrape:
            yield from node_families(snap)
        records, dropped = self._rank_store.counters()
        ranks = self._rank_store.ranks() if early is None else early
        uuids = {g.index: g.uuid for g in snap.gpus}
        resolved = {(r.run, r.rank): uuids[r.analysis.gpu] for r in ranks
                    if r.analysis is not None and r.analysis.gpu in uuids}
        ownership = self._owners.get()
        yield from self._step_families.steps(ranks, records, dropped, snap.processes, resolved,
                                             ownership)
        if scrape:
            live = {r.kernel_pid: (r.run, r.rank) for r in ranks
                    if r.kernel_pid is not None and r.exited_monotonic is None}
            yield from owner_families(ownership, snap.gpus, {
                index: sample.process_memory_bytes or {} for index, sample in snap.latest.items()},
                live)
        yield from self._step_families.analyses(ranks)
        yield from self._memory_families.families(ranks)
        yield from self._moe_families.families(ranks)
        monotonic = time.monotonic()
        yield from self._rank_state_families.families(rank_conditions(ranks, monotonic))
        yield from self._goodput_families.families(self._rank_store.time_totals(monotonic),
                                                   self._unsaved_alert_s())
        if scrape:
            yield from eviction_families(self._rank_store.evictions())
            yield from conflict_families(self._rank_store.conflicts())
            yield from ingest_families(self._ingest())
            yield from recording_families(self._recording())

    def describe(self) -> list[Metric]:
        """Every family ``collect`` can yield, so the registry can check their names against
        the other collectors'. Families that exist only with their feature (the host, the
        recording, the ingest socket) are described from stand-in readings; no I/O."""
        snap = replace(self._node.snapshot(time.time()), host=HostSample(0.0, 0.0, 0, 0))
        steps = StepFamilies()
        return [*node_families(snap), *steps.steps([], {}, {}, {}, {}),
                *owner_families(Ownership(), [], {}, {}), *steps.analyses([]),
                *MemoryFamilies().families([]), *MoeFamilies().families([]),
                *rank_state_families({}), *goodput_families({}, 0.0),
                *eviction_families({}), *conflict_families({}),
                *ingest_families(IngestStatus("", True, 0o660, "")),
                *recording_families(RecorderStatus("", 0, 0, 0, 0, None))]


def readiness(snap: NodeSnapshot, ingest_problem: str | None, now_monotonic: float,
              recording: RecorderStatus | None = None) -> tuple[bool, dict[str, Any]]:
    """(ready, body): ready unless nothing has been collected yet; says what is degraded."""
    problems: list[str] = []
    if not snap.nvml.up:
        problems.append(f"nvml: {snap.nvml.message}")
    for name, stats in sorted(snap.collectors.items()):
        started = stats.running_since_monotonic
        if stats.interval_s and started is not None and (
                now_monotonic - started > STUCK_AFTER_INTERVALS * stats.interval_s + 2.0):
            problems.append(f"{name}: cycle stuck for {now_monotonic - started:.0f}s")
    if ingest_problem:
        problems.append(f"ingest: {ingest_problem}")
    if recording is not None and recording.error:
        problems.append(f"recording: cannot write {recording.path}: {recording.error} "
                        f"({recording.backlog_bytes} bytes waiting, "
                        f"{recording.lines_dropped_total} lines dropped)")
    lost = [str(i) for i, s in snap.latest.items() if not s.up and s.error != NVML_TIMEOUT]
    if lost:
        problems.append(f"gpu lost: {', '.join(sorted(lost))}")
    hung = [str(i) for i, s in snap.latest.items() if not s.up and s.error == NVML_TIMEOUT]
    if hung:
        problems.append(f"gpu not answering NVML in time: {', '.join(sorted(hung))}")
    collected = any(s.last_success_t is not None for s in snap.collectors.values())
    status = "starting" if not collected else ("degraded" if problems else "ok")
    return collected, {"status": status, "problems": problems}


def snapshot_document(snap: NodeSnapshot, ranks: list[RankTotals],
                      ownership: Ownership | None = None) -> dict[str, Any]:
    """The node, its GPUs and its ranks (with their analyses and whose each is) as JSON-ready
    data."""
    ownership = ownership or Ownership()
    conditions = rank_conditions(ranks, time.monotonic())
    gpus = []
    for gpu in snap.gpus:
        sample = snap.latest.get(gpu.index)
        entry: dict[str, Any] = {
            "index": gpu.index, "uuid": gpu.uuid, "model": gpu.name,
            "pci_bus_id": gpu.pci_bus_id, "up": sample.up if sample else True,
        }
        if sample is not None:
            entry.update({k: v for k, v in _sample_dict(sample).items() if v is not None})
        gpus.append(entry)
    host = snap.host
    return {
        "version": __version__,
        "t": snap.t,
        "nvml": {"up": snap.nvml.up, "driver_version": snap.nvml.driver_version,
                 "nvml_version": snap.nvml.nvml_version, "simulated": snap.nvml.simulated,
                 "message": snap.nvml.message},
        "gpus": gpus,
        "host": None if host is None else {
            "cpu_utilization_ratio": host.cpu_utilization_ratio,
            "memory_used_bytes": host.memory_used_bytes,
            "memory_total_bytes": host.memory_total_bytes},
        "xid_errors": [{"gpu": g, "xid": x, "count": c}
                       for (g, x), c in sorted(snap.xid_counts.items())],
        "ranks": [{**_rank_dict(r, conditions.get((r.run, r.rank))),
                   "owner": asdict(ownership.of_pid(r.kernel_pid))}
                  for r in sorted(ranks, key=lambda r: (r.run, r.rank))],
    }


def _sample_dict(sample: GpuSample) -> dict[str, Any]:
    data = asdict(sample)
    data.pop("index", None)
    if data.get("process_memory_bytes"):
        data["process_memory_bytes"] = {str(k): v for k, v in data["process_memory_bytes"].items()}
    return data


def _rank_dict(state: RankTotals, condition: RankCondition | None) -> dict[str, Any]:
    analysis = state.analysis
    return {
        "run": state.run, "rank": state.rank, "world": state.world,
        "local_rank": state.local_rank, "pid": state.pid, "gpu": state.gpu_hint,
        "steps_total": state.steps_total, "last_step": state.last_step,
        "last_step_end_t": state.last_step_end_t,
        "phase_seconds_total": dict(state.phase_seconds_total),
        "memory_allocated_bytes": state.memory_allocated_bytes,
        "memory_reserved_bytes": state.memory_reserved_bytes,
        "memory_peak_bytes": state.memory_peak_bytes,
        "alloc_retries_total": state.alloc_retries_total, "ooms_total": state.ooms_total,
        "last_step_duration_seconds": state.last_duration_s,
        "memory_breakdown": None if state.memory_breakdown is None
        else asdict(state.memory_breakdown),
        "analysis": None if analysis is None else _analysis_dict(analysis),
        "condition": None if condition is None else _condition_dict(condition),
    }


def _condition_dict(condition: RankCondition) -> dict[str, Any]:
    """The rank's state and, while stalled, its place and stack (``gpumon stacks``)."""
    report = condition.report
    flight = None if report is None else report.in_flight
    stalled = condition.state == "stalled"
    return {
        "state": condition.state,
        "stalled_seconds": condition.stalled_s,
        "phase": condition.phase if stalled else None,
        "location": condition.location if stalled else None,
        "waits_on": list(condition.waits_on),
        "waits_on_label": waits_on_label(condition.waits_on),
        "collective": None if flight is None or not stalled else {
            "op": flight.op, "seq": flight.seq, "bytes": flight.nbytes, "since": flight.since,
            "on_device": flight.on_device},
        "collectives_launched": None if report is None else report.launched,
        "steps": None if report is None else report.steps,
        "stack": [] if report is None or not stalled else [
            {"file": f.file, "line": f.line, "function": f.function, "own": f.own}
            for f in report.stack],
    }


def _parallel_dict(layout: ParallelLayout | None) -> dict[str, Any] | None:
    """A rank's place in its job's parallelism: its index along each dimension it has, the
    dimensions of other names as the job named them, and where it was read."""
    if layout is None:
        return None
    found: dict[str, Any] = {dim: getattr(layout, dim) for dim in PARALLEL_DIMS
                             if getattr(layout, dim) is not None}
    found.update(layout.other)
    return {**found, "source": layout.source}


def _analysis_dict(analysis: RankAnalysis) -> dict[str, Any]:
    verdict, oom = analysis.verdict, analysis.oom
    return {
        "gpu": analysis.gpu, "verdict_step": analysis.verdict_step,
        "bottleneck": verdict.primary.value if verdict else None,
        "confidence": verdict.confidence if verdict else None,
        "flags": sorted(f.value for f in verdict.flags) if verdict else [],
        "hint": verdict.hint if verdict else None,
        "mfu": verdict.mfu if verdict else None,
        "bottleneck_steps": dict(analysis.bottleneck_steps),
        "straggler_score": analysis.straggler_score,
        "straggler_cause": analysis.straggler_cause.value if analysis.straggler_cause else None,
        "waiting_on_rank": analysis.slower_rank.rank if analysis.slower_rank else None,
        "bubble": verdict.bubble if verdict else None,
        "own_work_seconds": analysis.own_work_s,
        "parallel": _parallel_dict(analysis.parallel),
        "compared_with": "replicas" if analysis.parallel is not None else "run",
        "memory": None if analysis.memory is None else {
            "component": analysis.memory.component, "cause": analysis.memory.cause,
            "bytes": analysis.memory.bytes, "remedy": analysis.memory.remedy},
        "oom": None if oom is None else {
            "risk_ratio": oom.risk_ratio, "predicted_seconds": oom.predicted_seconds,
            "headroom_bytes": oom.headroom_bytes, "reasons": list(oom.reasons)},
    }
