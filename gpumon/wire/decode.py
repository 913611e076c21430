"""Decoding: datagrams into records, every limit of ``limits.FIELD_LIMITS`` applied.

``decode_datagram`` never raises. It returns the valid records and one reason from
``DROP_REASONS`` for every object (or whole datagram) it rejected; a batch with some bad
elements keeps the good ones.

A step record takes one of two paths. The fast path (``_fast_step``) accepts a record whose
every field has its usual form (a float or int within the table's bounds, a label seen
before) and builds it without a call per field; it never rejects. Anything else goes through
the full check (``_check_step``), field by field in a fixed order, which names the reason.
So the reason for a rejection always comes from one place, and the fast path only has to
agree with the full check on what it accepts: ``tests/wire/test_limits.py`` checks that on
generated records.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from gpumon.wire.decode_control import check_event, check_hello, check_span, check_state
from gpumon.wire.fields import KNOWN_LABELS as _KNOWN_LABELS
from gpumon.wire.fields import (
    check_comm,
    check_device_phases,
    check_gpu,
    check_identity,
    check_int,
    check_label,
    check_memory_breakdown,
    check_moe,
    check_number,
    opt_int,
    opt_number,
    required,
)
from gpumon.wire.frozen import maker
from gpumon.wire.limits import (
    FIELD_LIMITS,
    MAX_COLLECTIVE_CHARS,
    MAX_COLLECTIVE_KINDS,
    MAX_DATAGRAM_BYTES,
    MAX_PHASES,
    MAX_RECORDS_PER_DATAGRAM,
    MEMORY_COMPONENTS,
    PHASE_SLACK_RATIO,
    PHASE_SLACK_S,
    PROTOCOL_VERSION,
)
from gpumon.wire.records import (
    MEM_WIRE_NAMES,
    CollectiveOp,
    CommStats,
    DecodeResult,
    MemoryBreakdown,
    MemoryStats,
    ProtocolError,
    Record,
    StepRecord,
)


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
        return _fast_step(obj) or _check_step(obj)
    if kind == "event":
        return check_event(obj)
    if kind == "hello":
        return check_hello(obj)
    if kind == "span":
        return check_span(obj)
    if kind == "state":
        return check_state(obj)
    if kind is None:
        raise ProtocolError("missing_field", "kind")
    raise ProtocolError("bad_kind", repr(kind)[:32])


# --- the fast path ------------------------------------------------------------------------
# Bounds from the table, bound to names once: the fast path compares against these.

_RANK_HIGH = FIELD_LIMITS["rank"].high
_WORLD_LOW, _WORLD_HIGH = FIELD_LIMITS["world"].low, FIELD_LIMITS["world"].high
_DURATION_HIGH = FIELD_LIMITS["duration"].high  # excluded (``below``)
_STEP_HIGH = FIELD_LIMITS["step"].high
_T_START_HIGH = FIELD_LIMITS["t_start"].high
_SAMPLES_HIGH = FIELD_LIMITS["samples"].high
_TOKENS_HIGH = FIELD_LIMITS["tokens"].high
_FLOPS_HIGH = FIELD_LIMITS["flops"].high
_PID_LOW, _PID_HIGH = FIELD_LIMITS["pid"].low, FIELD_LIMITS["pid"].high
_GPU_HIGH = FIELD_LIMITS["gpu"].high
_MEM_HIGH = FIELD_LIMITS["mem"].high
_COUNT_HIGH = FIELD_LIMITS["comm.count"].high
_BYTES_HIGH = FIELD_LIMITS["comm.bytes"].high
_OP_SECONDS_HIGH = FIELD_LIMITS["comm.seconds"].high
_MEMB_HIGH = FIELD_LIMITS["memb"].high
_SLACK_FACTOR = 1 + PHASE_SLACK_RATIO
assert FIELD_LIMITS["duration"].below and all(
    FIELD_LIMITS[k].low == 0 for k in FIELD_LIMITS
    if k not in ("world", "pid") and not k.startswith("moe.")  # moe: the full check reads it
), "the fast path below assumes these bounds"
# The fast path's records, made without a frozen ``__init__``'s call per field (``frozen.py``).
_step_record = maker(StepRecord)
_memory_stats = maker(MemoryStats)
_memory_breakdown = maker(MemoryBreakdown)
_comm_stats = maker(CommStats)
_collective_op = maker(CollectiveOp)


def _fast_step(obj: dict[str, object]) -> StepRecord | None:
    """The record, if every field has its usual form; ``None`` sends it to the full check."""
    get = obj.get
    run = get("run")
    rank = get("rank")
    world = get("world")
    local_rank = get("local_rank")
    duration = get("duration")
    step = get("step")
    if not (
        type(run) is str and run in _KNOWN_LABELS
        and type(rank) is int and 0 <= rank <= _RANK_HIGH
        and type(duration) is float and 0.0 <= duration < _DURATION_HIGH
        and type(step) is int and 0 <= step <= _STEP_HIGH
    ):
        return None
    if world is not None:
        if not (type(world) is int and _WORLD_LOW <= world <= _WORLD_HIGH and rank < world):
            return None
    if local_rank is not None:
        if not (type(local_rank) is int and 0 <= local_rank <= _RANK_HIGH
                and (world is None or local_rank < world)):
            return None
    t_start = get("t_start")
    if t_start is not None and not (type(t_start) is float and 0.0 <= t_start <= _T_START_HIGH):
        return None
    samples = get("samples")
    if samples is not None and not (type(samples) is int and 0 <= samples <= _SAMPLES_HIGH):
        return None
    tokens = get("tokens")
    if tokens is not None and not (type(tokens) is int and 0 <= tokens <= _TOKENS_HIGH):
        return None
    flops = get("flops")
    if flops is not None and not (type(flops) is float and 0.0 <= flops <= _FLOPS_HIGH):
        return None
    gpu = get("gpu")
    if gpu is not None and not (type(gpu) is int and 0 <= gpu <= _GPU_HIGH) and not (
            type(gpu) is str and gpu in _KNOWN_LABELS):
        return None
    pid = get("pid")
    if pid is not None and not (type(pid) is int and _PID_LOW <= pid <= _PID_HIGH):
        return None
    slack = duration * _SLACK_FACTOR + PHASE_SLACK_S  # step_slack(duration), inline
    phases = get("phases")
    phases_s: dict[str, float] = {}
    if phases is not None:
        if type(phases) is not dict or len(phases) > MAX_PHASES:
            return None
        for name, seconds in phases.items():
            if not (name in _KNOWN_LABELS and type(seconds) is float and 0.0 <= seconds <= slack):
                return None
            phases_s[name] = seconds
    mem = get("mem")
    mem_stats = None
    if mem is not None:
        if type(mem) is not dict:
            return None
        counts = list(map(mem.get, MEM_WIRE_NAMES))
        for count in counts:
            if count is not None and not (type(count) is int and 0 <= count <= _MEM_HIGH):
                return None
        mem_stats = _memory_stats(*counts)
    comm = get("comm")
    comm_stats = None if comm is None else _fast_comm(comm, slack)
    if comm is not None and comm_stats is None:
        return None
    memb = get("memb")
    breakdown = None
    if memb is not None:
        if type(memb) is not dict:
            return None
        parts = list(map(memb.get, MEMORY_COMPONENTS))
        for part in parts:
            if part is not None and not (type(part) is int and 0 <= part <= _MEMB_HIGH):
                return None
        breakdown = _memory_breakdown(*parts)
    dev = get("dev")
    device_phases = None
    if dev is not None:
        if not (type(dev) is list and len(dev) <= len(phases_s)
                and all(type(n) is str and n in phases_s for n in dev) and len(set(dev)) == len(dev)):
            return None
        device_phases = tuple(dev)
    cpu_wait = get("cpu_wait")
    if cpu_wait is not None and not (type(cpu_wait) is float and 0.0 <= cpu_wait <= slack):
        return None
    if get("moe") is not None:
        return None  # a few records a second at most: the full check reads it
    return _step_record(run, rank, step, duration, world, local_rank, t_start, phases_s, samples,
                        tokens, flops, gpu, pid, mem_stats, comm_stats, breakdown,
                        device_phases, cpu_wait, None)


def _fast_comm(comm: object, slack: float) -> CommStats | None:
    if type(comm) is not dict:
        return None
    exposed, busy, ops = comm.get("exposed"), comm.get("busy"), comm.get("ops")
    bubble = comm.get("bubble")
    if not (type(exposed) is float and 0.0 <= exposed <= slack
            and type(busy) is float and 0.0 <= busy <= slack
            and (bubble is None or (type(bubble) is float and 0.0 <= bubble <= slack))):
        return None
    if ops is None:
        return _comm_stats(exposed, busy, (), bubble)
    if type(ops) is not dict or len(ops) > MAX_COLLECTIVE_KINDS:
        return None
    parsed = []
    for name, figures in ops.items():
        if not (name in _KNOWN_LABELS and len(name) <= MAX_COLLECTIVE_CHARS
                and type(figures) is list and len(figures) == 3):
            return None
        count, size, seconds = figures
        if not (type(count) is int and 0 <= count <= _COUNT_HIGH
                and type(size) is int and 0 <= size <= _BYTES_HIGH
                and type(seconds) is float and 0.0 <= seconds <= _OP_SECONDS_HIGH):
            return None
        parsed.append(_collective_op(name, count, size, seconds))
    return _comm_stats(exposed, busy, tuple(parsed), bubble)


# --- the full check -------------------------------------------------------------------


def _check_step(obj: Mapping[str, object]) -> StepRecord:
    run, rank, world, local_rank = check_identity(obj)
    duration = check_number(required(obj, "duration"), "duration")
    phases = obj.get("phases")
    phases_s: dict[str, float] = {}
    if phases is not None:
        if not isinstance(phases, dict):
            raise ProtocolError("bad_type", "phases")
        if len(phases) > MAX_PHASES:
            raise ProtocolError("bad_value", "too many phases")
        for name, seconds in phases.items():
            check_label(name, "phase")
            phases_s[name] = check_number(seconds, "phase", duration)
    mem = obj.get("mem")
    mem_stats = None
    if mem is not None:
        if not isinstance(mem, dict):
            raise ProtocolError("bad_type", "mem")
        mem_stats = MemoryStats(*[opt_int(mem, key, "mem") for key in MEM_WIRE_NAMES])
    step = check_int(required(obj, "step"), "step")
    t_start = opt_number(obj, "t_start")
    samples = opt_int(obj, "samples")
    tokens = opt_int(obj, "tokens")
    flops = opt_number(obj, "flops")
    gpu = check_gpu(obj)
    pid = opt_int(obj, "pid")
    comm = obj.get("comm")
    comm_stats = None if comm is None else check_comm(comm, duration)
    memb = obj.get("memb")
    breakdown = None if memb is None else check_memory_breakdown(memb)
    dev = obj.get("dev")
    device_phases = None if dev is None else check_device_phases(dev, phases_s)
    cpu_wait = obj.get("cpu_wait")
    cpu_wait_s = None if cpu_wait is None else check_number(cpu_wait, "cpu_wait", duration)
    moe = obj.get("moe")
    moe_stats = None if moe is None else check_moe(moe)
    return StepRecord(run, rank, step, duration, world, local_rank, t_start, phases_s, samples,
                      tokens, flops, gpu, pid, mem_stats, comm_stats, breakdown, device_phases,
                      cpu_wait_s, moe_stats)
