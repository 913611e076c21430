"""The records that travel from a training process to the agent, as the agent holds them.

Field meanings and their wire names are in docs/architecture.md §6; ``encode.to_wire`` and
``decode.decode_record`` translate between these dataclasses and the wire mappings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpumon.errors import GpumonError


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Allocator statistics of one step, from ``torch.cuda.memory_stats()``."""

    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None


MEM_WIRE_NAMES = ("allocated", "reserved", "peak", "retries", "ooms")
"""``MemoryStats``' fields by their wire names, in field order."""


@dataclass(frozen=True, slots=True)
class CollectiveOp:
    """One kind of collective in a step: how many ran, their payload and their summed time."""

    name: str
    count: int
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class CommStats:
    """Collective communication measured during one step.

    ``exposed_s`` is how long collectives held the training thread up, waiting on them or kept
    off a CPU by their threads (how much they lengthened the step); ``busy_s`` how long any
    collective was in flight (the union of their intervals, including what overlapped
    compute). Both are at most the step's duration.
    """

    exposed_s: float
    busy_s: float
    ops: tuple[CollectiveOp, ...] = ()
    bubble_s: float | None = None
    """Of ``exposed_s``, how long the training thread waited to receive from another rank
    (a pipeline stage waiting for its neighbour: its bubble); ``None`` when it received nothing
    point to point."""


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """A rank's memory by what holds it, in bytes, as sampled on some steps (absent: not measured)."""

    parameters: int | None = None
    gradients: int | None = None
    optimizer_states: int | None = None
    activations: int | None = None
    other: int | None = None


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """One MoE layer's routing over the last ``MoeStats.window`` steps: how many experts it
    has, the tokens routed (each token counted once per expert it went to), the busiest
    expert's tokens over the mean (1 when balanced), the coefficient of variation of the
    experts' tokens, and the experts that got none."""

    layer: str
    experts: int
    tokens: int
    max_ratio: float
    cv: float
    dead: int


@dataclass(frozen=True, slots=True)
class MoeStats:
    """A rank's expert load per MoE layer, summarised in the client over its last ``window``
    steps: the counts per expert never travel (64 experts x 32 layers would not fit a
    datagram), and the agent exports one series per layer, never per expert."""

    window: int
    layers: tuple[ExpertLoad, ...]


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
    comm: CommStats | None = None
    memory_breakdown: MemoryBreakdown | None = None
    device_phases: tuple[str, ...] | None = None
    """The phases whose seconds are GPU time from CUDA events (the wire's ``dev``); the others,
    and every phase of a step without it, are host-clock time. A rank on CUDA times its
    phases on the GPU on a sample of steps only: on the rest they measure kernel launches."""
    cpu_wait_s: float | None = None
    """Seconds of the step its training thread was runnable but waiting for a CPU (the
    kernel's run delay): time the host took from the rank, not work the rank did. ``None``:
    not measured."""
    moe: MoeStats | None = None
    """The expert load of the rank's MoE layers over its last steps (the wire's ``moe``)."""

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
class ParallelLayout:
    """A rank's place in its job's parallelism: its index along each dimension the job has
    (``None`` where it has none), and where the hook read it."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    cp: int | None = None
    source: str | None = None
    """``mesh``, ``pipeline``, ``deepspeed``, ``megatron`` or ``argument``."""
    other: tuple[tuple[str, int], ...] = ()
    """Dimensions of names gpumon does not map (a mesh's own), as the job named them."""

    @property
    def peers_key(self) -> tuple[object, ...]:
        """What the ranks that do the same work share: every coordinate but ``dp`` and ``ep``.
        Expert-parallel ranks hold different experts but run the same layers around them, and
        a balanced router gives each the same tokens: the one holding the busy experts is the
        one its peers wait for in the all-to-all, so they are compared with each other."""
        return (self.tp, self.pp, self.cp, self.other)


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
    framework: str | None = None
    """What drives the training loop, when a watcher knows (``deepspeed``)."""
    zero_stage: int | None = None
    """The ZeRO stage the framework runs (0-3), when it shards with ZeRO."""
    parallel: ParallelLayout | None = None
    """The rank's place in the job's parallelism, once the hook knows it."""


@dataclass(frozen=True, slots=True)
class StackFrame:
    """One frame of a training thread's Python stack: the file (its last path components),
    the line, the function, and whether it is the job's own code (not the interpreter's
    library, an installed package or gpumon)."""

    file: str
    line: int
    function: str
    own: bool


@dataclass(frozen=True, slots=True)
class InFlight:
    """The collective a rank's process has launched and not seen complete: its kind, its
    number among the collectives the process launched (from 1), payload bytes, unix time of
    its launch, and ``on_device`` when only the GPU's events say it has not finished (the
    host side returned; the kernel has not passed)."""

    op: str
    seq: int
    nbytes: int
    since: float
    on_device: bool = False


SPAN_KINDS = ("save", "saved", "load", "eval")
"""What a ``span`` record says the training thread did outside its steps: saved a checkpoint,
restored one, or evaluated the model; ``saved``: an asynchronous save it began earlier has
finished writing (its ``ok`` says how)."""


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """Time a rank's training thread spent outside its steps on something known: a
    checkpoint saved or restored, an evaluation pass.

    ``seconds`` is how long it held the training thread (an asynchronous save: only the part
    before the call returned, with ``pending`` set and no ``ok``: its outcome comes later in a
    ``saved`` record, whose ``seconds`` are how long it wrote in the background). ``ok`` is
    whether it succeeded. ``steps`` is how many steps the process had completed when it began
    (what a save covers; the ``saved`` of an asynchronous save repeats its save's). ``api``
    names what was called (``torch.save``, ``dcp``, ``safetensors``, ``hf``, ``accelerate``, ``deepspeed``,
    ``lightning``, ``mark``); ``bytes`` how much tensor data it held, where known."""

    run: str
    rank: int
    span: str
    seconds: float
    ok: bool | None = None
    steps: int | None = None
    api: str | None = None
    bytes: int | None = None
    pending: bool = False
    """An asynchronous save whose writing went on after ``seconds`` (a ``saved`` follows)."""
    t: float | None = None
    pid: int | None = None


RANK_STATES = ("stepping", "stalled", "closed", "evaluating")
"""What a rank's hook says of itself in a ``state`` record: steps arrive (or a step has not
yet lasted far longer than its typical one), no step for far longer than the typical one, the
monitor closed (the process may go on without steps), or no step for that long while the
training thread still progresses in PyTorch outside steps (an evaluation pass)."""


@dataclass(frozen=True, slots=True)
class StateRecord:
    """A rank's own word on whether it makes progress, sent by its hook's background thread
    every few seconds, and where its training thread is while it does not (``stalled``).

    ``since`` is the unix time of its last progress (a step ending), ``threshold_s`` how long
    without one it takes to be stalled, ``launched`` how many collectives the process has
    launched so far; ``phase`` the open phase (``None``: between steps), ``in_flight`` the
    collective not yet complete, ``stack`` the training thread's frames, innermost first.
    """

    run: str
    rank: int
    state: str
    t: float
    steps: int
    since: float | None = None
    threshold_s: float | None = None
    pid: int | None = None
    phase: str | None = None
    launched: int | None = None
    in_flight: InFlight | None = None
    stack: tuple[StackFrame, ...] = ()

    @property
    def location(self) -> StackFrame | None:
        """The innermost frame of the job's own code, if the stack has one."""
        return next((frame for frame in self.stack if frame.own), None)


Record = StepRecord | EventRecord | HelloRecord | StateRecord | SpanRecord
WireRecord = Mapping[str, object]


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """What one datagram held: the valid records and one reason per rejected object."""

    records: list[Record]
    rejected: list[str]


class ProtocolError(GpumonError, ValueError):
    """An object that is not a valid record; ``reason`` is one of ``DROP_REASONS``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
