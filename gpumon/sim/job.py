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

What each phase kind changes is in ``profiles.PROFILES``; a straggler phase slows one rank's
compute, a leak phase grows every rank's memory toward capacity. The shared timeline, and what
each step shows the agent, are ``timeline``'s; this module runs the ranks through it (and still
exports the names of both).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from gpumon.client import StepMonitor
from gpumon.sim.gpus import SimulatedSource
from gpumon.sim.profiles import (
    BUCKETS,
    FLOPS_PER_STEP,
    GRADIENT_BYTES,
    PROFILES,
    SAMPLES_PER_STEP,
    TOKENS_PER_STEP,
    Kernels,
    Profile,
    describe,
)
from gpumon.sim.schedule import Schedule
from gpumon.sim.timeline import (
    Cycle,
    RankStep,
    Timeline,
    comm_fields,
    gpu_activity,
    idle_activity,
    plan_cycle,
)


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
