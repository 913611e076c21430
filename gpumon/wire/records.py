"""Step-record wire protocol shared by the client hook and the agent (stdlib only).

One JSON object per datagram (UTF-8, at most ``MAX_DATAGRAM_BYTES``), or a JSON array of
such objects when the client batches. docs/architecture.md §6 describes every field.

Encoding: ``to_wire`` turns a record into its wire mapping; ``encode_datagrams`` packs wire
mappings (or records) into JSON-array datagrams that each fit ``MAX_DATAGRAM_BYTES``.

Decoding: ``decode_datagram`` never raises. It returns the valid records and one reason from
``DROP_REASONS`` for every object (or whole datagram) it rejected; a batch with some bad
elements keeps the good ones.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

PROTOCOL_VERSION = 1
MAX_DATAGRAM_BYTES = 8192

KNOWN_PHASES = ("data", "forward", "backward", "comm", "optimizer")
KINDS = ("step", "event", "hello")

MAX_RECORDS_PER_DATAGRAM = 256
MAX_RUN_CHARS = 128
MAX_LABEL_CHARS = 64
"""Longest phase or event name."""
MAX_GPU_CHARS = 128
MAX_MESSAGE_CHARS = 1024
MAX_PHASES = 32
MAX_RANKS = 1 << 20
"""Largest accepted world size; rank and local_rank must be below it."""
MAX_GPU_INDEX = 4096
MAX_INT = (1 << 63) - 1
MAX_PID = (1 << 32) - 1
MAX_DURATION_S = 86_400.0
"""A step (or phase) must last less than a day."""
PHASE_SLACK_RATIO = 0.01
PHASE_SLACK_S = 0.001
"""A phase may exceed its step's duration by this much (rounding by clients)."""
MAX_UNIX_TIME_S = 1e10
MAX_FLOPS = 1e30
MAX_COLLECTIVE_KINDS = 16
"""Most kinds of collective (``all_reduce``, ``all_gather``, ...) one step's ``comm`` may list."""
MAX_COLLECTIVE_CHARS = 32
"""Longest collective kind name."""

MEMORY_COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "other")
"""The parts of a rank's memory the sampled breakdown (``memb``) names, in wire and field order."""

DROP_REASONS = (
    "too_large",
    "not_utf8",
    "not_json",
    "not_object",
    "too_many_records",
    "bad_version",
    "bad_kind",
    "missing_field",
    "bad_type",
    "bad_value",
    "bad_label",
    "bad_comm",
    "bad_memory_breakdown",
)
"""Every reason ``decode_datagram`` can give for a rejected object or datagram."""

_LABEL = re.compile(r"[A-Za-z0-9_.:/-]+")


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Allocator statistics of one step, from ``torch.cuda.memory_stats()``."""

    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None


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

    ``exposed_s`` is how long the training thread was blocked waiting on collectives (how much
    they lengthened the step); ``busy_s`` how long any collective was in flight (the union of
    their intervals, including what overlapped compute). Both are at most the step's duration.
    """

    exposed_s: float
    busy_s: float
    ops: tuple[CollectiveOp, ...] = ()


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """A rank's memory by what holds it, in bytes, as sampled on some steps (absent: not measured)."""

    parameters: int | None = None
    gradients: int | None = None
    optimizer_states: int | None = None
    activations: int | None = None
    other: int | None = None


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
WireRecord = Mapping[str, object]


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """What one datagram held: the valid records and one reason per rejected object."""

    records: list[Record]
    rejected: list[str]


class ProtocolError(ValueError):
    """An object that is not a valid record; ``reason`` is one of ``DROP_REASONS``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# --- encoding ---------------------------------------------------------------------------

_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)

_MEM_WIRE = (
    ("allocated", "allocated_bytes"),
    ("reserved", "reserved_bytes"),
    ("peak", "peak_bytes"),
    ("retries", "alloc_retries"),
    ("ooms", "ooms"),
)
_MEM_KEYS = tuple(wire for wire, _ in _MEM_WIRE)  # in MemoryStats' field order


def to_wire(record: Record) -> dict[str, object]:
    """The wire mapping of a record (docs/architecture.md §6), absent fields omitted."""
    out: dict[str, object] = {"v": PROTOCOL_VERSION}
    if isinstance(record, StepRecord):
        out["kind"] = "step"
        fields: dict[str, object] = {
            "run": record.run,
            "rank": record.rank,
            "world": record.world,
            "local_rank": record.local_rank,
            "step": record.step,
            "t_start": record.t_start,
            "duration": record.duration_s,
            "phases": dict(record.phases_s) if record.phases_s else None,
            "samples": record.samples,
            "tokens": record.tokens,
            "flops": record.flops,
            "gpu": record.gpu,
            "pid": record.pid,
        }
        if record.mem is not None:
            mem = {w: getattr(record.mem, a) for w, a in _MEM_WIRE}
            fields["mem"] = {k: v for k, v in mem.items() if v is not None}
        if record.comm is not None:
            fields["comm"] = _comm_wire(record.comm)
        if record.memory_breakdown is not None:
            parts = {name: getattr(record.memory_breakdown, name) for name in MEMORY_COMPONENTS}
            fields["memb"] = {k: v for k, v in parts.items() if v is not None}
    elif isinstance(record, EventRecord):
        out["kind"] = "event"
        fields = {
            "run": record.run,
            "rank": record.rank,
            "event": record.event,
            "t": record.t,
            "step": record.step,
            "pid": record.pid,
            "gpu": record.gpu,
            "message": record.message,
        }
    else:
        out["kind"] = "hello"
        fields = {
            "run": record.run,
            "rank": record.rank,
            "world": record.world,
            "local_rank": record.local_rank,
            "pid": record.pid,
            "gpu": record.gpu,
            "client_version": record.client_version,
        }
    out.update((k, v) for k, v in fields.items() if v is not None)
    return out


def _comm_wire(comm: CommStats) -> dict[str, object]:
    """The ``comm`` field of a step: ``{"exposed", "busy", "ops": {name: [count, bytes, s]}}``."""
    out: dict[str, object] = {"exposed": comm.exposed_s, "busy": comm.busy_s}
    if comm.ops:
        out["ops"] = {op.name: [op.count, op.bytes, op.seconds] for op in comm.ops}
    return out


STEP_MEASURED_FIELDS = ("comm", "memb")
"""Optional step fields a watcher on the training thread may add (see ``encode_measured_field``)."""


def encode_measured_field(name: str, value: object, duration_s: float) -> str:
    """``,"name":{...}`` for a measured step field (``comm`` or ``memb``) given in its wire
    shape, written from what the decoder makes of it: what is sent is exactly what the agent
    will accept. Raises ``ProtocolError`` for an unknown name or a value the agent would drop
    (which would cost the whole step record)."""
    wire: dict[str, object]
    if name == "comm":
        wire = _comm_wire(_comm(value, duration_s))
    elif name == "memb":
        breakdown = _memory_breakdown(value)
        wire = {k: v for k in MEMORY_COMPONENTS if (v := getattr(breakdown, k)) is not None}
    else:
        raise ProtocolError("bad_type", f"{name!r} is not a measured step field")
    return f',"{name}":{_ENCODER.encode(wire)}'


def encode_record(record: WireRecord | Record) -> bytes:
    """One record as a compact JSON object (also the line format of recordings)."""
    wire = record if isinstance(record, Mapping) else to_wire(record)
    return _ENCODER.encode(wire).encode("ascii")


def encode_records(records: Sequence[WireRecord | Record]) -> bytes:
    """Records as one JSON array, whatever its size (see ``encode_datagrams`` to split)."""
    return b"[" + b",".join(encode_record(r) for r in records) + b"]"


def encode_datagrams(
    records: Iterable[WireRecord | Record], max_bytes: int = MAX_DATAGRAM_BYTES
) -> list[bytes]:
    """Pack records into JSON-array datagrams of at most ``max_bytes`` each, in order.

    Raises ``ValueError`` for values JSON cannot carry (NaN, infinity).
    """
    return [data for data, _ in pack_datagrams((encode_record(r) for r in records), max_bytes)]


def pack_datagrams(encoded: Iterable[bytes], max_bytes: int = MAX_DATAGRAM_BYTES) -> list[tuple[bytes, int]]:
    """Pack encoded records into JSON arrays of at most ``max_bytes``: (datagram, count) pairs.

    A single record too large for any datagram still gets one of its own (the receiver
    rejects it as ``too_large``); records built from valid fields are far below the limit.
    """
    datagrams: list[tuple[bytes, int]] = []
    batch: list[bytes] = []
    size = 2  # the brackets
    for item in encoded:
        if batch and size + 1 + len(item) > max_bytes:
            datagrams.append((b"[" + b",".join(batch) + b"]", len(batch)))
            batch, size = [], 2
        size += len(item) + (1 if batch else 0)
        batch.append(item)
    if batch:
        datagrams.append((b"[" + b",".join(batch) + b"]", len(batch)))
    return datagrams


# --- decoding ---------------------------------------------------------------------------


def decode_datagram(data: bytes) -> DecodeResult:
    """Parse and validate one datagram; never raises, whatever ``data`` holds."""
    if len(data) > MAX_DATAGRAM_BYTES:
        return DecodeResult([], ["too_large"])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return DecodeResult([], ["not_utf8"])
    try:
        value: object = json.loads(text)
    except (ValueError, RecursionError):
        # ValueError covers malformed JSON and integers beyond the int-string limit;
        # RecursionError covers absurd nesting.
        return DecodeResult([], ["not_json"])
    if isinstance(value, list):
        if len(value) > MAX_RECORDS_PER_DATAGRAM:
            return DecodeResult([], ["too_many_records"])
        items: list[object] = value
    else:
        items = [value]
    records: list[Record] = []
    rejected: list[str] = []
    for item in items:
        try:
            records.append(decode_record(item))
        except ProtocolError as err:
            rejected.append(err.reason)
    return DecodeResult(records, rejected)


def decode_record(obj: object) -> Record:
    """Validate one decoded JSON value as a record; raises ``ProtocolError`` if invalid."""
    if not isinstance(obj, dict):
        raise ProtocolError("not_object", type(obj).__name__)
    if "v" not in obj:
        raise ProtocolError("missing_field", "v")
    if type(obj["v"]) is not int or obj["v"] != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", repr(obj["v"])[:32])
    kind = obj.get("kind")
    if kind == "step":
        return _decode_step(obj)
    if kind == "event":
        return _decode_event(obj)
    if kind == "hello":
        return _decode_hello(obj)
    if kind is None:
        raise ProtocolError("missing_field", "kind")
    raise ProtocolError("bad_kind", repr(kind)[:32])


def is_label(value: str, max_chars: int = MAX_LABEL_CHARS) -> bool:
    """Whether ``value`` may be a run or phase name: 1..max_chars of ``[A-Za-z0-9_.:/-]``."""
    return 0 < len(value) <= max_chars and _LABEL.fullmatch(value) is not None


def _decode_step(obj: dict[str, object]) -> StepRecord:
    # The hot path of ingest. Each field's usual value (a plain int or float within range, a
    # label seen before) is taken as it is; anything else goes through the general check,
    # field by field in the same order, so a bad record is refused for the same reason.
    run, rank, world, local_rank = _identity(obj)
    duration = obj.get("duration")
    if type(duration) is not float or not 0.0 <= duration < MAX_DURATION_S:
        duration = _check_number(_required(obj, "duration"), "duration", MAX_DURATION_S,
                                 below=True)
    phases = obj.get("phases")
    phases_s: dict[str, float] = {}
    if phases is not None:
        if not isinstance(phases, dict):
            raise ProtocolError("bad_type", "phases")
        if len(phases) > MAX_PHASES:
            raise ProtocolError("bad_value", "too many phases")
        limit = duration * (1 + PHASE_SLACK_RATIO) + PHASE_SLACK_S
        for name, seconds in phases.items():
            if name not in _KNOWN_LABELS:
                _check_label(name, "phase", MAX_LABEL_CHARS)
            if type(seconds) is float and 0.0 <= seconds <= limit:
                phases_s[name] = seconds
            else:
                phases_s[name] = _check_number(seconds, "phase", limit)
    mem = obj.get("mem")
    mem_stats = None
    if mem is not None:
        if not isinstance(mem, dict):
            raise ProtocolError("bad_type", "mem")
        counts: list[int | None] = []
        for wire in _MEM_KEYS:
            value = mem.get(wire)
            if value is None or (type(value) is int and 0 <= value <= MAX_INT):
                counts.append(value)
            else:
                counts.append(_check_int(value, wire, MAX_INT))
        mem_stats = MemoryStats(*counts)
    step = obj.get("step")
    if type(step) is not int or not 0 <= step <= MAX_INT:
        step = _check_int(_required(obj, "step"), "step", MAX_INT)
    t_start = obj.get("t_start")
    if t_start is not None and (type(t_start) is not float or not 0.0 <= t_start <= MAX_UNIX_TIME_S):
        t_start = _check_number(t_start, "t_start", MAX_UNIX_TIME_S)
    samples = obj.get("samples")
    if samples is not None and (type(samples) is not int or not 0 <= samples <= MAX_INT):
        samples = _check_int(samples, "samples", MAX_INT)
    tokens = obj.get("tokens")
    if tokens is not None and (type(tokens) is not int or not 0 <= tokens <= MAX_INT):
        tokens = _check_int(tokens, "tokens", MAX_INT)
    flops = obj.get("flops")
    if flops is not None and (type(flops) is not float or not 0.0 <= flops <= MAX_FLOPS):
        flops = _check_number(flops, "flops", MAX_FLOPS)
    gpu = obj.get("gpu")
    if not (type(gpu) is int and 0 <= gpu < MAX_GPU_INDEX) and not (
            type(gpu) is str and gpu in _KNOWN_LABELS):
        gpu = _gpu(obj)
    pid = obj.get("pid")
    if pid is not None and (type(pid) is not int or not 0 < pid <= MAX_PID):
        pid = _pid(obj)
    comm = obj.get("comm")
    comm_stats = None if comm is None else _comm(comm, duration)
    memb = obj.get("memb")
    breakdown = None if memb is None else _memory_breakdown(memb)
    return StepRecord(run, rank, step, duration, world, local_rank, t_start, phases_s, samples,
                      tokens, flops, gpu, pid, mem_stats, comm_stats, breakdown)


def _decode_event(obj: dict[str, object]) -> EventRecord:
    run, rank, _, _ = _identity(obj)
    return EventRecord(
        run=run,
        rank=rank,
        event=_check_label(_required(obj, "event"), "event", MAX_LABEL_CHARS),
        t=_opt_number(obj, "t", MAX_UNIX_TIME_S),
        step=_opt_int(obj, "step", MAX_INT),
        pid=_pid(obj),
        gpu=_gpu(obj),
        message=_opt_text(obj, "message", MAX_MESSAGE_CHARS),
    )


def _decode_hello(obj: dict[str, object]) -> HelloRecord:
    run, rank, world, local_rank = _identity(obj)
    version = obj.get("client_version")
    return HelloRecord(
        run=run,
        rank=rank,
        world=world,
        local_rank=local_rank,
        pid=_pid(obj),
        gpu=_gpu(obj),
        client_version=None if version is None else _check_label(version, "client_version", MAX_LABEL_CHARS),
    )


def _identity(obj: Mapping[str, object]) -> tuple[str, int, int | None, int | None]:
    # Hot: usual values are taken as they are, anything else is checked in full (see above).
    run = obj.get("run")
    if type(run) is not str or run not in _KNOWN_LABELS:
        run = _check_label(_required(obj, "run"), "run", MAX_RUN_CHARS)
    rank = obj.get("rank")
    if type(rank) is not int or not 0 <= rank < MAX_RANKS:
        rank = _check_int(_required(obj, "rank"), "rank", MAX_RANKS - 1)
    world = obj.get("world")
    if world is not None and (type(world) is not int or not 0 <= world <= MAX_RANKS):
        world = _check_int(world, "world", MAX_RANKS)
    local_rank = obj.get("local_rank")
    if local_rank is not None and (type(local_rank) is not int
                                   or not 0 <= local_rank < MAX_RANKS):
        local_rank = _check_int(local_rank, "local_rank", MAX_RANKS - 1)
    if world is not None:
        if world < 1:
            raise ProtocolError("bad_value", "world")
        if rank >= world or (local_rank is not None and local_rank >= world):
            raise ProtocolError("bad_value", "rank not below world")
    return run, rank, world, local_rank


def _required(obj: Mapping[str, object], key: str) -> object:
    value = obj.get(key)
    if value is None:
        raise ProtocolError("missing_field", key)
    return value


def _check_int(value: object, what: str, maximum: int) -> int:
    if type(value) is not int:  # bool is an int subclass: not accepted
        raise ProtocolError("bad_type", what)
    if not 0 <= value <= maximum:
        raise ProtocolError("bad_value", what)
    return value


def _check_number(value: object, what: str, maximum: float, below: bool = False) -> float:
    if type(value) is not int and type(value) is not float:
        raise ProtocolError("bad_type", what)
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        raise ProtocolError("bad_value", what) from None
    if not math.isfinite(number) or number < 0 or number > maximum or (below and number == maximum):
        raise ProtocolError("bad_value", what)
    return number


_KNOWN_LABELS: set[str] = set()
"""Labels already validated (run and phase names repeat in every record); bounded."""
_KNOWN_LABELS_MAX = 4096


def _check_label(value: object, what: str, max_chars: int) -> str:
    if not isinstance(value, str):
        raise ProtocolError("bad_type", what)
    if len(value) <= MAX_LABEL_CHARS and value in _KNOWN_LABELS:
        return value if len(value) <= max_chars else _bad_label(what)
    if not is_label(value, max_chars):
        raise ProtocolError("bad_label", what)
    if len(value) <= MAX_LABEL_CHARS and len(_KNOWN_LABELS) < _KNOWN_LABELS_MAX:
        _KNOWN_LABELS.add(value)
    return value


def _bad_label(what: str) -> str:
    raise ProtocolError("bad_label", what)


def _opt_int(obj: Mapping[str, object], key: str, maximum: int) -> int | None:
    value = obj.get(key)
    return None if value is None else _check_int(value, key, maximum)


def _opt_number(obj: Mapping[str, object], key: str, maximum: float) -> float | None:
    value = obj.get(key)
    return None if value is None else _check_number(value, key, maximum)


def _opt_text(obj: Mapping[str, object], key: str, max_chars: int) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProtocolError("bad_type", key)
    if len(value) > max_chars:
        raise ProtocolError("bad_value", key)
    try:
        value.encode("utf-8")  # lone surrogates from "\ud800" escapes
    except UnicodeEncodeError:
        raise ProtocolError("bad_value", key) from None
    return value


def _gpu(obj: Mapping[str, object]) -> str | int | None:
    value = obj.get("gpu")
    if value is None:
        return None
    if isinstance(value, str):
        return _check_label(value, "gpu", MAX_GPU_CHARS)
    return _check_int(value, "gpu", MAX_GPU_INDEX - 1)


def _pid(obj: Mapping[str, object]) -> int | None:
    pid = _opt_int(obj, "pid", MAX_PID)
    if pid == 0:
        raise ProtocolError("bad_value", "pid")
    return pid


def _comm(value: object, duration: float) -> CommStats:
    """A step's ``comm`` field; anything wrong in it is ``bad_comm``."""
    if not isinstance(value, dict):
        raise ProtocolError("bad_comm", "not an object")
    limit = duration * (1 + PHASE_SLACK_RATIO) + PHASE_SLACK_S
    exposed = _comm_number(value.get("exposed"), "exposed", limit)
    busy = _comm_number(value.get("busy"), "busy", limit)
    ops_value = value.get("ops")
    ops: list[CollectiveOp] = []
    if ops_value is not None:
        if not isinstance(ops_value, dict):
            raise ProtocolError("bad_comm", "ops")
        if len(ops_value) > MAX_COLLECTIVE_KINDS:
            raise ProtocolError("bad_comm", "too many collective kinds")
        for name, figures in ops_value.items():
            if not is_label(name, MAX_COLLECTIVE_CHARS):
                raise ProtocolError("bad_comm", "collective name")
            if not isinstance(figures, list) or len(figures) != 3:
                raise ProtocolError("bad_comm", f"{name}: expected [count, bytes, seconds]")
            count, size, seconds = figures
            if not (type(count) is int and 0 <= count <= MAX_INT
                    and type(size) is int and 0 <= size <= MAX_INT):
                raise ProtocolError("bad_comm", f"{name}: count and bytes")
            ops.append(CollectiveOp(name, count, size,
                                    _comm_number(seconds, name, MAX_DURATION_S)))
    return CommStats(exposed, busy, tuple(ops))


def _comm_number(value: object, what: str, maximum: float) -> float:
    if type(value) is float and 0.0 <= value <= maximum:
        return value
    if type(value) is int and 0 <= value <= maximum:
        return float(value)
    raise ProtocolError("bad_comm", what)


def _memory_breakdown(value: object) -> MemoryBreakdown:
    """A step's ``memb`` field; anything wrong in it is ``bad_memory_breakdown``."""
    if not isinstance(value, dict):
        raise ProtocolError("bad_memory_breakdown", "not an object")
    parts: list[int | None] = []
    for name in MEMORY_COMPONENTS:
        size = value.get(name)
        if size is not None and not (type(size) is int and 0 <= size <= MAX_INT):
            raise ProtocolError("bad_memory_breakdown", name)
        parts.append(size)
    return MemoryBreakdown(*parts)
