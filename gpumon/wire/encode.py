"""Encoding: records into their wire mappings, compact JSON and datagrams that fit.

``to_wire`` turns a record into its wire mapping (absent fields omitted); ``encode_record``
writes one as compact JSON (also the line format of recordings); ``pack_datagrams`` packs
encoded records into JSON-array datagrams that each fit ``MAX_DATAGRAM_BYTES``. The training
process formats its step records with ``step_encoder.StepEncoder`` instead, which writes the
same JSON faster.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from gpumon.wire.fields import check_comm, check_memory_breakdown, check_moe, check_number
from gpumon.wire.limits import MAX_DATAGRAM_BYTES, MEMORY_COMPONENTS, PARALLEL_DIMS, PROTOCOL_VERSION
from gpumon.wire.records import (
    MEM_WIRE_NAMES,
    CommStats,
    EventRecord,
    MemoryBreakdown,
    MoeStats,
    ParallelLayout,
    ProtocolError,
    Record,
    SpanRecord,
    StateRecord,
    StepRecord,
    WireRecord,
)

_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_MEM_ATTRIBUTES = ("allocated_bytes", "reserved_bytes", "peak_bytes", "alloc_retries", "ooms")


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
            mem = {w: getattr(record.mem, a) for w, a in zip(MEM_WIRE_NAMES, _MEM_ATTRIBUTES, strict=True)}
            fields["mem"] = {k: v for k, v in mem.items() if v is not None}
        if record.comm is not None:
            fields["comm"] = _comm_wire(record.comm)
        if record.memory_breakdown is not None:
            fields["memb"] = _breakdown_wire(record.memory_breakdown)
        if record.device_phases is not None:
            fields["dev"] = list(record.device_phases)
        fields["cpu_wait"] = record.cpu_wait_s
        if record.moe is not None:
            fields["moe"] = _moe_wire(record.moe)
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
    elif isinstance(record, StateRecord):
        out["kind"] = "state"
        fields = _state_wire(record)
    elif isinstance(record, SpanRecord):
        out["kind"] = "span"
        fields = {
            "run": record.run,
            "rank": record.rank,
            "span": record.span,
            "seconds": record.seconds,
            "ok": record.ok,
            "steps": record.steps,
            "api": record.api,
            "bytes": record.bytes,
            "pending": record.pending or None,
            "t": record.t,
            "pid": record.pid,
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
            "framework": record.framework,
            "zero_stage": record.zero_stage,
            "parallel": _parallel_wire(record.parallel) if record.parallel else None,
        }
    out.update((k, v) for k, v in fields.items() if v is not None)
    return out


def encode_record(record: WireRecord | Record) -> bytes:
    """One record as a compact JSON object (also the line format of recordings).

    Raises ``ValueError`` for values JSON cannot carry (NaN, infinity)."""
    wire = record if isinstance(record, Mapping) else to_wire(record)
    return _ENCODER.encode(wire).encode("ascii")


def encode_measured_field(name: str, value: object, duration_s: float) -> str:
    """``,"name":...`` for a measured step field (``comm``, ``memb``, ``cpu_wait``, ``moe``) given in its wire
    shape, written from what the decoder makes of it: what is sent is exactly what the agent
    will accept. Raises ``ProtocolError`` for an unknown name or a value the agent would drop
    (which would cost the whole step record)."""
    wire: dict[str, object]
    if name == "comm":
        wire = _comm_wire(check_comm(value, duration_s))
    elif name == "memb":
        wire = _breakdown_wire(check_memory_breakdown(value))
    elif name == "moe":
        wire = _moe_wire(check_moe(value))
    elif name == "cpu_wait":  # a finite float: its repr is its JSON
        return f',"cpu_wait":{check_number(value, name, duration_s)!r}'
    else:
        raise ProtocolError("bad_type", f"{name!r} is not a measured step field")
    return f',"{name}":{_ENCODER.encode(wire)}'


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


def _moe_wire(moe: MoeStats) -> dict[str, object]:
    return {"window": moe.window,
            "layers": {load.layer: [load.experts, load.tokens, load.max_ratio, load.cv, load.dead]
                       for load in moe.layers}}


def _state_wire(record: StateRecord) -> dict[str, object]:
    flight = record.in_flight
    return {
        "run": record.run,
        "rank": record.rank,
        "state": record.state,
        "t": record.t,
        "steps": record.steps,
        "since": record.since,
        "threshold": record.threshold_s,
        "pid": record.pid,
        "phase": record.phase,
        "launched": record.launched,
        "flight": None if flight is None else {
            "op": flight.op, "seq": flight.seq, "bytes": flight.nbytes, "since": flight.since,
            "device": flight.on_device},
        "stack": [[f.file, f.line, f.function, f.own] for f in record.stack] or None,
    }


def _comm_wire(comm: CommStats) -> dict[str, object]:
    out: dict[str, object] = {"exposed": comm.exposed_s, "busy": comm.busy_s}
    if comm.ops:
        out["ops"] = {op.name: [op.count, op.bytes, op.seconds] for op in comm.ops}
    if comm.bubble_s is not None:
        out["bubble"] = comm.bubble_s
    return out


def _parallel_wire(layout: ParallelLayout) -> dict[str, object]:
    out: dict[str, object] = {dim: getattr(layout, dim) for dim in PARALLEL_DIMS
                              if getattr(layout, dim) is not None}
    if layout.source is not None:
        out["source"] = layout.source
    if layout.other:
        out["other"] = dict(layout.other)
    return out


def _breakdown_wire(breakdown: MemoryBreakdown) -> dict[str, object]:
    parts = {name: getattr(breakdown, name) for name in MEMORY_COMPONENTS}
    return {k: v for k, v in parts.items() if v is not None}
