"""Step-record wire protocol shared by the client hook and the agent (stdlib only).

One JSON object per datagram (UTF-8, at most ``MAX_DATAGRAM_BYTES``), or a JSON array of
such objects when the client batches. See DESIGN §6.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROTOCOL_VERSION = 1
MAX_DATAGRAM_BYTES = 8192

KNOWN_PHASES = ("data", "forward", "backward", "comm", "optimizer")


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Allocator statistics of one step, from ``torch.cuda.memory_stats()``."""

    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One training step as reported by a rank."""

    run: str
    rank: int
    step: int
    duration_s: float
    world: int | None = None
    local_rank: int | None = None
    t_start: float | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    samples: int | None = None
    tokens: int | None = None
    flops: float | None = None
    gpu: str | int | None = None
    pid: int | None = None
    mem: MemoryStats | None = None

    @property
    def t_end(self) -> float | None:
        """Unix time the step ended, when its start is known."""
        return None if self.t_start is None else self.t_start + self.duration_s


@dataclass(frozen=True, slots=True)
class EventRecord:
    """A discrete event from a rank, e.g. ``oom`` when an OutOfMemoryError escaped a step."""

    run: str
    rank: int
    event: str
    t: float | None = None
    step: int | None = None
    pid: int | None = None
    gpu: str | int | None = None
    message: str | None = None


@dataclass(frozen=True, slots=True)
class HelloRecord:
    """Sent once when a client starts: who it is."""

    run: str
    rank: int
    world: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    gpu: str | int | None = None
    client_version: str | None = None


Record = StepRecord | EventRecord | HelloRecord
