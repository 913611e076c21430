"""The simulated job's shared timeline: every rank's step, cycle by cycle (``Timeline``,
``Cycle``, ``plan_cycle``), and what each step shows the agent: its GPU's counters
(``gpu_activity``) and its ``comm`` field (``comm_fields``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from gpumon.sim.gpus import Activity
from gpumon.sim.profiles import (
    BASE_PEAK_RATIO,
    BUCKETS,
    CACHE_BYTES,
    CONTEXT_BYTES,
    GRADIENT_BYTES,
    PERSISTENT_RATIO,
    PROFILES,
    WAITING_FOR_DATA,
    WAITING_FOR_PEERS,
    Kernels,
)
from gpumon.sim.schedule import Phase, PhaseKind, Schedule

FALLEN_BEHIND_S = 1.0
"""A timeline this far behind the clock (the process was stopped or starved) restarts now."""


@dataclass(frozen=True)
class RankStep:
    """One rank's part of a step: its own phase durations and allocator statistics."""

    data_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    memory: dict[str, int]


@dataclass(frozen=True)
class Cycle:
    """One synchronous step of every rank, on the monotonic clock."""

    n: int
    position: int
    """The schedule position (``Schedule.at``) the step belongs to."""
    phase: Phase
    steps: tuple[RankStep, ...]
    starts: tuple[float, ...]
    """Each rank's step start: when its loader is asked for the batch."""
    allreduce_start: float
    """When the slowest rank finished its backward pass."""
    allreduce_end: float
    """When every rank's ``comm`` phase ends and its optimizer step starts."""

    def end(self, rank: int) -> float:
        """When ``rank``'s step ends (its optimizer step done)."""
        return self.allreduce_end + self.steps[rank].optimizer_s


def plan_cycle(schedule: Schedule, position: int, into_s: float, world: int,
               capacity_bytes: int) -> tuple[Phase, tuple[RankStep, ...], float]:
    """Every rank's step at ``into_s`` seconds into the phase at ``position``, and the
    exposed all-reduce time."""
    phase = schedule.phase(position)
    profile = PROFILES[phase.kind]
    slow_rank = world - 1 if phase.rank is None else phase.rank
    memory = _memory(phase, min(1.0, into_s / phase.seconds), capacity_bytes)
    steps = []
    for rank in range(world):
        scale = phase.slowdown if phase.kind is PhaseKind.STRAGGLER and rank == slow_rank else 1.0
        steps.append(RankStep(profile.data_s, profile.forward_s * scale,
                              profile.backward_s * scale, profile.optimizer_s * scale, memory))
    return phase, tuple(steps), profile.allreduce_s


def _memory(phase: Phase, progress: float, capacity_bytes: int) -> dict[str, int]:
    leaked = 0
    if phase.kind is PhaseKind.LEAK:
        leaked = int((phase.peak_ratio - BASE_PEAK_RATIO) * capacity_bytes * progress)
    peak = int(BASE_PEAK_RATIO * capacity_bytes) + leaked
    return {"allocated": int(PERSISTENT_RATIO * capacity_bytes) + leaked,
            "reserved": peak + CACHE_BYTES, "peak": peak, "retries": 0, "ooms": 0}


def gpu_activity(cycle: Cycle, rank: int) -> Activity:
    """What ``rank``'s GPU shows on average over its step in ``cycle``."""
    step = cycle.steps[rank]
    profile = PROFILES[cycle.phase.kind]
    ready = cycle.starts[rank] + step.data_s + step.forward_s + step.backward_s
    allreduce = Kernels(1.0, 0.08, 0.05, 0.0, 0.15, nvlink_ratio=profile.link_ratio)
    overlap = replace(profile.kernels, nvlink_ratio=profile.overlap_link_ratio)
    segments = (
        (step.data_s, WAITING_FOR_DATA),
        (step.forward_s + step.optimizer_s, profile.kernels),
        (step.backward_s, overlap),
        (max(0.0, cycle.allreduce_start - ready), WAITING_FOR_PEERS),
        (cycle.allreduce_end - cycle.allreduce_start, allreduce),
    )
    total = sum(seconds for seconds, _ in segments)

    def mean(name: str) -> float:
        return sum(seconds * float(getattr(k, name)) for seconds, k in segments) / total

    return Activity(
        utilization=mean("utilization"), sm_active=mean("sm_active"),
        sm_occupancy=mean("sm_occupancy"), tensor_active=mean("tensor_active"),
        dram_active=mean("dram_active"), nvlink_ratio=mean("nvlink_ratio"),
        pcie_ratio=mean("pcie_ratio"),
        memory_used_bytes=step.memory["reserved"] + CONTEXT_BYTES,
    )


def comm_fields(cycle: Cycle, rank: int) -> dict[str, object]:
    """The ``comm`` field of ``rank``'s step in ``cycle``, as the client's DDP watcher measures
    it: blocked from the end of its own backward work until the all-reduce ends (waiting for
    the slowest rank, then the last buckets), and in flight beside that while backward ran."""
    step = cycle.steps[rank]
    ready = cycle.starts[rank] + step.data_s + step.forward_s + step.backward_s
    exposed = cycle.allreduce_end - ready
    busy = exposed + PROFILES[cycle.phase.kind].overlapped_share * step.backward_s
    return {"exposed": exposed, "busy": busy,
            "ops": {"all_reduce": [BUCKETS, GRADIENT_BYTES, busy]}}


def idle_activity() -> Activity:
    """A GPU no rank uses."""
    return Activity(memory_used_bytes=CONTEXT_BYTES)


class Timeline:
    """The shared clock of a synchronous job: computes each cycle once, for every rank."""

    def __init__(self, schedule: Schedule, world: int, capacity_bytes: int, t0: float,
                 loop: bool) -> None:
        self.schedule = schedule
        self.world = world
        self.capacity_bytes = capacity_bytes
        self.t0 = t0
        self.loop = loop
        self._lock = threading.Lock()
        self._cycles: dict[int, Cycle | None] = {}

    def cycle(self, n: int, now: float) -> Cycle | None:
        """Cycle ``n`` (computed from cycle ``n - 1`` on first request); ``None`` once a
        single pass is over."""
        with self._lock:
            if n not in self._cycles:
                previous = self._cycles.get(n - 1) if n else None
                if n and previous is None:
                    return None
                self._cycles[n] = self._next(n, previous, now)
                self._cycles.pop(n - 64, None)
            return self._cycles[n]

    def _next(self, n: int, previous: Cycle | None, now: float) -> Cycle | None:
        if previous is None:
            starts = (self.t0,) * self.world
            begin = self.t0
        else:
            starts = tuple(previous.end(r) for r in range(self.world))
            begin = previous.allreduce_end
            if now - begin > FALLEN_BEHIND_S:
                # Racing through missed steps would flood the agent with empty ones.
                shift = now - begin
                self.t0 += shift
                starts = tuple(s + shift for s in starts)
                begin = now
        where = self.schedule.at(begin - self.t0, self.loop)
        if where is None:
            return None
        position, into_s = where
        phase, steps, allreduce_s = plan_cycle(self.schedule, position, into_s, self.world,
                                               self.capacity_bytes)
        start = max(s + st.data_s + st.forward_s + st.backward_s for s, st in zip(starts, steps, strict=True))
        return Cycle(n, position, phase, steps, starts, start, start + allreduce_s)
