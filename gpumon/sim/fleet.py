"""A simulated training run spread over many nodes: one run, ``nodes × ranks_per_node``
ranks, each node's ranks reporting to that node's agent.

Where :class:`gpumon.sim.job.SimulatedJob` runs one thread and one real hook per rank
(right for a node or a few), a fleet of hundreds of ranks on a small machine needs a
cheaper sender: :class:`FleetSender` builds each rank's step record as the wire protocol
carries it (phases, the ``comm`` field a watched DDP job adds, allocator memory, the sampled
memory breakdown, the rank's GPU) and sends it to the rank's node's socket, from one thread,
once per simulated step. The records are those of synchronous data parallelism: every rank's
step lasts as long as the slowest rank's own work plus the all-reduce, and a faster rank waits
the difference in its backward phase, blocked on the collective — so the run-level rules see
a straggler (``straggler``, computing ``slowdown`` × as long) only when they see all of its
nodes.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

GIB = 1024**3
GRADIENT_BYTES = 2_600_000_000  # bf16 gradients of a 1.3B-parameter model
BUCKETS = 100  # DDP's 25 MiB buckets
SAMPLES = 8
TOKENS = SAMPLES * 2048
FLOPS = 6 * 1.3e9 * TOKENS


@dataclass(frozen=True)
class FleetRun:
    """One run over ``nodes`` nodes of ``ranks_per_node`` ranks (global rank = node ×
    ranks_per_node + local rank). A step's own work is ``compute_s`` (data wait included:
    ``data_s`` of it), the all-reduce's unhidden cost ``allreduce_s``; ``straggler`` (a
    global rank, or None) takes ``slowdown`` × the others' compute."""

    name: str
    nodes: int
    ranks_per_node: int
    compute_s: float = 0.8
    data_s: float = 0.05
    allreduce_s: float = 0.1
    straggler: int | None = None
    slowdown: float = 1.5
    memory_breakdown_every: int = 5
    capacity_bytes: int = 80 * GIB

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError("a run needs at least one node of at least one rank")
        if self.straggler is not None and not 0 <= self.straggler < self.world:
            raise ValueError(f"straggler rank {self.straggler} is outside 0..{self.world - 1}")
        if not 0 <= self.data_s < self.compute_s:
            raise ValueError("data_s must be below compute_s")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def own_s(self, rank: int) -> float:
        """A rank's own work per step (its compute, data wait included)."""
        return self.compute_s * (self.slowdown if rank == self.straggler else 1.0)

    @property
    def step_s(self) -> float:
        """Every rank's step: the slowest rank's own work, then the all-reduce."""
        return max(self.own_s(r) for r in self._candidates()) + self.allreduce_s

    def _candidates(self) -> Sequence[int]:
        return (0,) if self.straggler is None else (0, self.straggler)

    def ranks_of(self, node: int) -> range:
        first = node * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def record(self, rank: int, step: int, t_end: float, gpu: str | None) -> dict[str, object]:
        """The step record rank ``rank`` sends for step ``step``, ending at ``t_end``."""
        duration = self.step_s
        own = self.own_s(rank)
        exposed = duration - own  # waiting for the slowest rank, then the all-reduce
        forward = (own - self.data_s) / 3
        backward = forward * 2 * 0.9
        optimizer = own - self.data_s - forward - backward
        peak = int(self.capacity_bytes * 0.6)
        record: dict[str, object] = {
            "v": 1, "kind": "step", "run": self.name, "rank": rank, "world": self.world,
            "local_rank": rank % self.ranks_per_node, "step": step,
            "t_start": t_end - duration, "duration": duration,
            "phases": {"data": self.data_s, "forward": forward, "backward": backward + exposed,
                       "optimizer": optimizer},
            "comm": {"exposed": exposed, "busy": exposed + self.allreduce_s,
                     "ops": {"all_reduce": [BUCKETS, GRADIENT_BYTES, exposed + self.allreduce_s]}},
            "samples": SAMPLES, "tokens": TOKENS, "flops": FLOPS,
            "mem": {"allocated": peak - 2 * GIB, "reserved": peak + GIB // 2, "peak": peak,
                    "retries": 0, "ooms": 0},
        }
        if gpu is not None:
            record["gpu"] = gpu
        if self.memory_breakdown_every and step % self.memory_breakdown_every == 0:
            quarter = peak // 4
            record["memb"] = {"parameters": quarter // 2, "gradients": quarter // 2,
                              "optimizer_states": quarter, "activations": quarter,
                              "other": peak - 3 * quarter}
        return record


class FleetSender:
    """Sends ``run``'s steps, in real time, to each node's agent: ``sockets[node]``, with the
    rank on local GPU ``i`` naming ``gpus[node][i]`` (or no GPU when that list is short)."""

    def __init__(self, run: FleetRun, sockets: Sequence[str],
                 gpus: Sequence[Sequence[str]] | None = None) -> None:
        if len(sockets) != run.nodes:
            raise ValueError(f"{run.nodes} nodes need {run.nodes} sockets, got {len(sockets)}")
        self.run = run
        self.sockets = list(sockets)
        self.gpus = [list(g) for g in gpus] if gpus is not None else [[] for _ in sockets]
        self.sent = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"fleet-{run.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def send_step(self, step: int, t_end: float, sock: socket.socket) -> None:
        """Every rank's record of one step, each to its node's socket."""
        for node, path in enumerate(self.sockets):
            gpus = self.gpus[node]
            for rank in self.run.ranks_of(node):
                local = rank % self.run.ranks_per_node
                gpu = gpus[local % len(gpus)] if gpus else None
                data = json.dumps(self.run.record(rank, step, t_end, gpu)).encode()
                try:
                    sock.sendto(data, path)
                    self.sent += 1
                except OSError:  # an agent restarting or gone: its node misses the step
                    self.failed += 1

    def _loop(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            step, next_end = 0, time.time() + self.run.step_s
            while not self._stop.wait(max(0.0, next_end - time.time())):
                self.send_step(step, next_end, sock)
                step += 1
                next_end += self.run.step_s
                if next_end < time.time() - self.run.step_s:  # fell behind: resume from now
                    next_end = time.time() + self.run.step_s
        finally:
            sock.close()
