"""A synthetic data-parallel training job that runs in real time through the real client hook.

Each rank is a thread with its own ``StepMonitor`` (its own rank number and GPU) sending to
the agent's real socket. The ranks follow one shared timeline, as synchronous data
parallelism does: the gradient all-reduce ends once the slowest rank has finished its
backward pass, so every rank's step lasts the same, and a faster rank spends the difference
waiting at the end of its ``backward`` phase — where DDP makes a real job wait. A rank sleeps
through each phase of its step to the timeline's deadline, so the hook measures real
durations; before each step it sets its GPU's simulated counters to what that step makes the
GPU do (the time-weighted mix of data wait, kernels, waiting on peers and the all-reduce), so
the agent sees consistent hardware and timings.

The collectives are reported as a watched DDP job reports them: a step extension of the
rank's monitor (``monitor.extensions.attach``, the seam ``watch()`` uses) adds the step's
``comm`` field — the time blocked on the all-reduce, the time buckets were in flight, and
the all-reduce's count and bytes — to the record, through the same sender, wire format and
agent as a real job's.

What each phase kind changes is in ``PROFILES``; a straggler phase slows one rank's compute,
a leak phase grows every rank's memory toward capacity.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from gpumon.client import StepMonitor
from gpumon.sim.gpus import Activity, SimulatedSource
from gpumon.sim.schedule import Phase, PhaseKind, Schedule

PARAMS = 1.3e9
SAMPLES_PER_STEP = 8
TOKENS_PER_STEP = SAMPLES_PER_STEP * 2048
FLOPS_PER_STEP = 6 * PARAMS * TOKENS_PER_STEP  # forward + backward, per rank
"""A 1.3B-parameter model on 8 sequences of 2048 tokens per rank and step: about 0.13 PFLOP,
which makes a compute-bound step of ~0.25 s run at ~50 % MFU on an H100."""

GRADIENT_BYTES = int(2 * PARAMS)
"""bf16 gradients, all-reduced every step."""
BUCKET_BYTES = 25 * 1024**2
"""DDP's default bucket size (``bucket_cap_mb=25``): one all-reduce per bucket."""
BUCKETS = math.ceil(GRADIENT_BYTES / BUCKET_BYTES)

BASE_PEAK_RATIO = 0.60
"""Per-step allocator peak (weights, gradients, optimizer states and activations) ÷ capacity."""
PERSISTENT_RATIO = 0.30
"""What stays allocated between steps (weights, gradients, optimizer states) ÷ capacity."""
CACHE_BYTES = 512 * 1024**2
"""Memory the allocator keeps reserved above the peak."""
CONTEXT_BYTES = 512 * 1024**2
"""What NVML counts beyond the allocator's reservation: the CUDA context."""
FALLEN_BEHIND_S = 1.0
"""A timeline this far behind the clock (the process was stopped or starved) restarts now."""


@dataclass(frozen=True)
class Kernels:
    """What a GPU shows while it runs one kind of work, as ratios of its peak."""

    utilization: float
    sm_active: float
    sm_occupancy: float
    tensor_active: float
    dram_active: float
    nvlink_ratio: float = 0.0
    pcie_ratio: float = 0.0


DENSE = Kernels(1.0, 0.93, 0.50, 0.76, 0.36)
"""Large bf16 matrix multiplications: tensor cores busy, HBM well below its roof."""
MEMORY_BOUND = Kernels(1.0, 0.90, 0.62, 0.14, 0.86)
"""Unfused element-wise and normalisation kernels: HBM at its roof, tensor cores idle."""
LAUNCH_BOUND = Kernels(0.60, 0.30, 0.12, 0.20, 0.12)
"""Tiny kernels with gaps between launches: the CPU cannot issue them fast enough. NVML's
utilisation (any kernel running) stays well above the SM activity."""
WAITING_FOR_DATA = Kernels(0.0, 0.0, 0.0, 0.0, 0.0, pcie_ratio=0.02)
WAITING_FOR_PEERS = Kernels(1.0, 0.06, 0.03, 0.0, 0.02)
"""An all-reduce kernel already launched, spinning until the slowest rank joins."""
IDLE = Kernels(0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Profile:
    """One phase kind's step: phase durations (seconds) and the kernels it runs."""

    description: str
    kernels: Kernels = DENSE
    data_s: float = 0.003
    forward_s: float = 0.075
    backward_s: float = 0.14
    optimizer_s: float = 0.02
    allreduce_s: float = 0.01
    """The all-reduce once every rank is ready (the part not overlapped with backward)."""
    link_ratio: float = 0.9
    """NVLink use during that all-reduce, of the link's peak."""
    overlap_link_ratio: float = 0.15
    """NVLink use during backward, where bucketed all-reduces overlap it."""
    overlapped_share: float = 0.8
    """Share of backward during which a bucket's all-reduce is in flight (DDP launches the
    first bucket soon after backward starts)."""


_HEALTHY = Profile("compute-bound: tensor cores busy, MFU about 50 %")
PROFILES: dict[PhaseKind, Profile] = {
    PhaseKind.COMPUTE: _HEALTHY,
    PhaseKind.INPUT: replace(_HEALTHY, data_s=0.26,
                             description="input-bound: the data loader cannot keep up, "
                                         "GPUs idle half of each step"),
    PhaseKind.COMMUNICATION: replace(_HEALTHY, allreduce_s=0.2, link_ratio=0.85,
                                     overlap_link_ratio=0.0, overlapped_share=0.0,
                                     description="communication-bound: the gradient all-reduce "
                                                 "is no longer overlapped, NVLink saturated"),
    PhaseKind.MEMORY_BANDWIDTH: replace(_HEALTHY, kernels=MEMORY_BOUND, forward_s=0.16,
                                        backward_s=0.29, optimizer_s=0.045,
                                        description="memory-bandwidth-bound: unfused kernels "
                                                    "keep HBM busy and tensor cores idle"),
    PhaseKind.HOST: replace(_HEALTHY, kernels=LAUNCH_BOUND, forward_s=0.19, backward_s=0.30,
                            optimizer_s=0.06,
                            description="host-bound: many tiny kernels, the CPU cannot launch "
                                        "them fast enough"),
    PhaseKind.STRAGGLER: replace(_HEALTHY, description="one rank computes slower; its peers "
                                                       "wait for it in the all-reduce"),
    PhaseKind.LEAK: replace(_HEALTHY, description="memory leak: every step's peak grows "
                                                  "toward capacity"),
}


def describe(phase: Phase) -> str:
    """A one-line account of what the job does in ``phase``."""
    text = PROFILES[phase.kind].description
    if phase.kind is PhaseKind.STRAGGLER:
        text += f" (compute x{phase.slowdown:g})"
    elif phase.kind is PhaseKind.LEAK:
        text += f" (to {phase.peak_ratio:.0%} by the end)"
    return text


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


class _MeasuredComm:
    """A step extension of a rank's monitor that reports the timeline's all-reduce for the
    step the rank is in (set in ``pending`` before the step ends)."""

    def __init__(self) -> None:
        self.pending: dict[str, object] | None = None

    def step_begin(self) -> None:
        """Nothing to start: the timeline already knows the step's communication."""

    def step_end(self, fields: dict[str, object]) -> None:
        """Add the step's ``comm`` field."""
        if self.pending is not None:
            fields["comm"], self.pending = self.pending, None


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


def check_job(schedule: Schedule, ranks: int, gpus: int, *, rank_offset: int = 0,
              world: int | None = None) -> None:
    """ValueError unless ``ranks`` ranks on ``gpus`` GPUs, the ranks from ``rank_offset`` of a
    run of ``world`` ranks (default: just these), can run ``schedule``."""
    world = ranks if world is None else world
    if not 1 <= ranks <= gpus:
        raise ValueError(f"{ranks} ranks on {gpus} GPUs: a data-parallel job runs one rank per "
                         "GPU, so ranks must be between 1 and the GPU count")
    if rank_offset < 0 or rank_offset + ranks > world:
        raise ValueError(f"ranks {rank_offset}-{rank_offset + ranks - 1} on this node, but the "
                         f"run has ranks 0-{world - 1}")
    for n, phase in enumerate(schedule.phases, 1):
        if phase.rank is not None and phase.rank >= world:
            raise ValueError(f"{schedule.source}: phase {n}: straggler rank {phase.rank}, "
                             f"but the job has ranks 0-{world - 1}")


class _Stopped(Exception):
    """Raised inside a rank's step when the job stops: the step is not recorded."""


class SimulatedJob:
    """A data-parallel job of ``ranks`` ranks on the first GPUs of ``source``, one per GPU.

    ``start()`` launches the ranks; ``stop()`` ends them (the step in progress is not
    recorded), closes their monitors and leaves the GPUs idle. Without ``loop`` the job
    ends by itself after one pass through the schedule (``wait``).

    A run spread over several nodes is one job per node, each given the run's ``world`` size
    and its first rank (``rank_offset``): the node runs ranks ``rank_offset`` to
    ``rank_offset + ranks - 1`` on its GPUs 0 to ``ranks - 1``. Every node plans the whole
    run's steps, so its ranks wait in the all-reduce for a straggler on another node.
    """

    def __init__(self, source: SimulatedSource, schedule: Schedule, *, ranks: int,
                 socket_path: str, run: str = "demo", loop: bool = True, rank_offset: int = 0,
                 world: int | None = None) -> None:
        gpus = source.statics()
        check_job(schedule, ranks, len(gpus), rank_offset=rank_offset, world=world)
        self.source = source
        self.schedule = schedule
        self.ranks = ranks
        self.rank_offset = rank_offset
        self.world = ranks if world is None else world
        self.socket_path = socket_path
        self.run = run
        self.loop = loop
        self._gpus = gpus[:ranks]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._timeline: Timeline | None = None

    def start(self) -> None:
        """Start every rank now."""
        for gpu in self.source.statics()[self.ranks:]:
            self.source.set_activity(gpu.index, idle_activity())
        self._timeline = Timeline(self.schedule, self.world, self.source.model.memory_total_bytes,
                                  time.monotonic(), self.loop)
        self._threads = [threading.Thread(target=self._run_rank, args=(rank,),
                                          name=f"gpumon-sim-rank{rank}", daemon=True)
                         for rank in range(self.rank_offset, self.rank_offset + self.ranks)]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every rank and leave the GPUs idle; safe to call twice."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for gpu in self.source.statics():
            self.source.set_activity(gpu.index, idle_activity())

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every rank has finished; whether they have."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def position(self) -> tuple[int, float] | None:
        """The schedule position and seconds into it now (``Schedule.at``); ``None`` before
        ``start`` or after a single pass."""
        timeline = self._timeline
        if timeline is None:
            return None
        return self.schedule.at(time.monotonic() - timeline.t0, self.loop)

    def _run_rank(self, rank: int) -> None:
        local_rank = rank - self.rank_offset
        monitor = StepMonitor(run=self.run, socket_path=self.socket_path, rank=rank,
                              world=self.world, local_rank=local_rank,
                              gpu=self._gpus[local_rank].uuid)
        comm = monitor.extensions.attach(_MeasuredComm)
        try:
            for cycle in monitor.loader(self._batches(rank)):
                step = cycle.steps[rank]
                comm.pending = comm_fields(cycle, rank)
                with monitor.step(samples=SAMPLES_PER_STEP, tokens=TOKENS_PER_STEP,
                                  flops=FLOPS_PER_STEP, memory=step.memory):
                    with monitor.phase("forward"):
                        self._sleep_until(cycle.starts[rank] + step.data_s + step.forward_s)
                    with monitor.phase("backward"):  # its own work, then waiting for the peers
                        self._sleep_until(cycle.allreduce_end)
                    with monitor.phase("optimizer"):
                        self._sleep_until(cycle.end(rank))
        except _Stopped:
            pass
        finally:
            monitor.close()

    def _batches(self, rank: int) -> Iterator[Cycle]:
        """The rank's data loader: sets its GPU's counters for the step, waits for the batch."""
        assert self._timeline is not None
        index = self._gpus[rank - self.rank_offset].index
        n = 0
        while True:
            cycle = self._timeline.cycle(n, time.monotonic())
            if cycle is None:
                return
            self.source.set_activity(index, gpu_activity(cycle, rank))
            self._sleep_until(cycle.starts[rank] + cycle.steps[rank].data_s)
            yield cycle
            n += 1

    def _sleep_until(self, deadline: float) -> None:
        if self._stop.wait(max(0.0, deadline - time.monotonic())):
            raise _Stopped


__all__ = ["BUCKETS", "FLOPS_PER_STEP", "GRADIENT_BYTES", "PROFILES", "Cycle", "Kernels",
           "Profile", "RankStep", "SimulatedJob", "Timeline", "check_job", "comm_fields",
           "describe", "gpu_activity", "idle_activity", "plan_cycle"]
