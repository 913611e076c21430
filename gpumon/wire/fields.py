"""The full check of single fields, shared by the decoder's full check and the client's encoder.

Numbers against their row of ``limits.FIELD_LIMITS``; labels against ``LABEL_LIMITS``, with the
labels already validated remembered for the decoder's fast path (``KNOWN_LABELS``); and the
measured step fields (``comm``, ``memb``, ``dev``, ``moe``), each refused with its own reason;
and what every record's check reads the same way (its identity, required and optional fields).
Every function returns the checked value or raises ``ProtocolError``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gpumon.wire.limits import (
    FIELD_LIMITS,
    LABEL_LIMITS,
    MAX_COLLECTIVE_KINDS,
    MAX_LABEL_CHARS,
    MAX_MOE_LAYERS,
    MAX_OTHER_DIMS,
    MEMORY_COMPONENTS,
    MOE_RATIO_SLACK,
    PARALLEL_DIMS,
    is_label,
)
from gpumon.wire.records import (
    CollectiveOp,
    CommStats,
    ExpertLoad,
    MemoryBreakdown,
    MoeStats,
    ParallelLayout,
    ProtocolError,
)

__all__ = [
    "KNOWN_LABELS",
    "check_comm",
    "check_device_phases",
    "check_int",
    "check_label",
    "check_memory_breakdown",
    "check_moe",
    "check_parallel",
    "check_number",
    "remember_label",
]


def check_comm(value: object, duration_s: float) -> CommStats:
    """A step's ``comm`` field for a step of ``duration_s``; anything wrong in it is ``bad_comm``."""
    if not isinstance(value, dict):
        raise ProtocolError("bad_comm", "not an object")
    exposed = check_number(value.get("exposed"), "comm.exposed", duration_s)
    busy = check_number(value.get("busy"), "comm.busy", duration_s)
    bubble_value = value.get("bubble")
    bubble = None if bubble_value is None \
        else check_number(bubble_value, "comm.bubble", duration_s)
    ops_value = value.get("ops")
    ops: list[CollectiveOp] = []
    if ops_value is not None:
        if not isinstance(ops_value, dict):
            raise ProtocolError("bad_comm", "ops")
        if len(ops_value) > MAX_COLLECTIVE_KINDS:
            raise ProtocolError("bad_comm", "too many collective kinds")
        for name, figures in ops_value.items():
            if not (isinstance(name, str) and is_label(name, LABEL_LIMITS["collective"])):
                raise ProtocolError("bad_comm", "collective name")
            if not isinstance(figures, list) or len(figures) != 3:
                raise ProtocolError("bad_comm", f"{name}: expected [count, bytes, seconds]")
            count = check_int(figures[0], "comm.count")
            size = check_int(figures[1], "comm.bytes")
            ops.append(CollectiveOp(name, count, size, check_number(figures[2], "comm.seconds")))
            remember_label(name)
    return CommStats(exposed, busy, tuple(ops), bubble)


def check_parallel(value: object) -> ParallelLayout:
    """A hello's ``parallel`` field; anything wrong in it is ``bad_parallel``."""
    if not isinstance(value, dict):
        raise ProtocolError("bad_parallel", "not an object")
    unknown = set(value) - {*PARALLEL_DIMS, "source", "other"}
    if unknown:
        raise ProtocolError("bad_parallel", f"unknown key {sorted(unknown)[0]!r}")
    coordinates = {dim: None if value.get(dim) is None else check_int(value[dim], "parallel")
                   for dim in PARALLEL_DIMS}
    source = value.get("source")
    other = value.get("other") or {}
    if not isinstance(other, dict) or len(other) > MAX_OTHER_DIMS:
        raise ProtocolError("bad_parallel", "other")
    for name in other:
        if not (isinstance(name, str) and is_label(name, LABEL_LIMITS["parallel"])):
            raise ProtocolError("bad_parallel", "dimension name")
    return ParallelLayout(
        **coordinates,
        source=None if source is None else _parallel_label(source),
        other=tuple(sorted((name, check_int(index, "parallel")) for name, index in other.items())))


def _parallel_label(value: object) -> str:
    if not (isinstance(value, str) and is_label(value, LABEL_LIMITS["parallel"])):
        raise ProtocolError("bad_parallel", "source")
    return value


def check_memory_breakdown(value: object) -> MemoryBreakdown:
    """A step's ``memb`` field; anything wrong in it is ``bad_memory_breakdown``."""
    if not isinstance(value, dict):
        raise ProtocolError("bad_memory_breakdown", "not an object")
    parts = [value.get(name) for name in MEMORY_COMPONENTS]
    return MemoryBreakdown(*[None if part is None else check_int(part, "memb") for part in parts])


def check_moe(value: object) -> MoeStats:
    """A step's ``moe`` field, ``{"window": steps, "layers": {layer: [experts, tokens,
    max_ratio, cv, dead]}}``; anything wrong in it is ``bad_moe``. Beyond each figure's range,
    the figures of one layer must agree: with tokens routed, at least one expert got some
    (``dead < experts``), and no expert can hold more than all of them (``max_ratio <=
    experts``, ``cv <= sqrt(experts - 1)``)."""
    if not isinstance(value, dict):
        raise ProtocolError("bad_moe", "not an object")
    unknown = set(value) - {"window", "layers"}
    if unknown:
        raise ProtocolError("bad_moe", f"unknown key {sorted(unknown)[0]!r}")
    window = check_int(value.get("window"), "moe.window")
    layers_value = value.get("layers")
    if not isinstance(layers_value, dict) or not layers_value:
        raise ProtocolError("bad_moe", "layers")
    if len(layers_value) > MAX_MOE_LAYERS:
        raise ProtocolError("bad_moe", "too many layers")
    layers = []
    for name, figures in layers_value.items():
        if not (isinstance(name, str) and is_label(name, LABEL_LIMITS["layer"])):
            raise ProtocolError("bad_moe", "layer name")
        if not isinstance(figures, list) or len(figures) != 5:
            raise ProtocolError("bad_moe", f"{name}: expected [experts, tokens, max_ratio, cv, dead]")
        experts = check_int(figures[0], "moe.experts")
        tokens = check_int(figures[1], "moe.tokens")
        max_ratio = check_number(figures[2], "moe.max_ratio")
        cv = check_number(figures[3], "moe.cv")
        dead = check_int(figures[4], "moe.dead")
        if not (dead < experts and max_ratio <= experts + MOE_RATIO_SLACK
                and cv <= math.sqrt(experts - 1) + MOE_RATIO_SLACK):
            raise ProtocolError("bad_moe", f"{name}: figures that cannot be one layer's")
        layers.append(ExpertLoad(name, experts, tokens, max_ratio, cv, dead))
    return MoeStats(window, tuple(layers))


def check_device_phases(value: object, phases: Mapping[str, float]) -> tuple[str, ...]:
    """A step's ``dev`` field: distinct names of its own ``phases``; else ``bad_device_phases``."""
    if not isinstance(value, list):
        raise ProtocolError("bad_device_phases", "not a list")
    for name in value:
        if not (isinstance(name, str) and is_label(name, LABEL_LIMITS["dev"])):
            raise ProtocolError("bad_device_phases", "phase name")
        if name not in phases:
            raise ProtocolError("bad_device_phases", f"{name}: not one of the step's phases")
    if len(set(value)) != len(value):
        raise ProtocolError("bad_device_phases", "a phase named twice")
    return tuple(value)


def check_int(value: object, key: str) -> int:
    """``value`` as the integer field ``key`` of ``FIELD_LIMITS``, else ``ProtocolError``."""
    limit = FIELD_LIMITS[key]
    if type(value) is not int:  # bool is an int subclass: not accepted
        raise ProtocolError(limit.type_reason, key)
    if not limit.low <= value <= limit.high:
        raise ProtocolError(limit.value_reason, key)
    return value


def check_number(value: object, key: str, duration_s: float = 0.0) -> float:
    """``value`` as the number field ``key`` of ``FIELD_LIMITS`` (in a step of ``duration_s``
    when its bound is the step's), else ``ProtocolError``."""
    limit = FIELD_LIMITS[key]
    if type(value) is not int and type(value) is not float:
        raise ProtocolError(limit.type_reason, key)
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        raise ProtocolError(limit.value_reason, key) from None
    high = limit.high_for(duration_s)
    if not (math.isfinite(number) and limit.low <= number <= high) or (limit.below and number == high):
        raise ProtocolError(limit.value_reason, key)
    return number


KNOWN_LABELS: set[str] = set()
"""Labels of at most ``MAX_LABEL_CHARS`` already validated (run, phase and collective names
and GPU UUIDs repeat in every record), for the fast path; bounded."""
KNOWN_LABELS_MAX = 4096


def check_label(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError("bad_type", key)
    max_chars = LABEL_LIMITS[key]
    if value in KNOWN_LABELS and len(value) <= max_chars:
        return value
    if not is_label(value, max_chars):
        raise ProtocolError("bad_label", key)
    remember_label(value)
    return value


def remember_label(label: str) -> None:
    if len(label) <= MAX_LABEL_CHARS and len(KNOWN_LABELS) < KNOWN_LABELS_MAX:
        KNOWN_LABELS.add(label)


def check_identity(obj: Mapping[str, object]) -> tuple[str, int, int | None, int | None]:
    run = check_label(required(obj, "run"), "run")
    rank = check_int(required(obj, "rank"), "rank")
    world = opt_int(obj, "world")
    local_rank = opt_int(obj, "local_rank")
    if world is not None and (rank >= world or (local_rank is not None and local_rank >= world)):
        raise ProtocolError("bad_value", "rank not below world")
    return run, rank, world, local_rank


def required(obj: Mapping[str, object], key: str) -> object:
    value = obj.get(key)
    if value is None:
        raise ProtocolError("missing_field", key)
    return value


def opt_int(obj: Mapping[str, object], key: str, limit: str | None = None) -> int | None:
    value = obj.get(key)
    return None if value is None else check_int(value, limit or key)


def opt_number(obj: Mapping[str, object], key: str) -> float | None:
    value = obj.get(key)
    return None if value is None else check_number(value, key)


def opt_text(obj: Mapping[str, object], key: str, max_chars: int) -> str | None:
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


def check_gpu(obj: Mapping[str, object]) -> str | int | None:
    value = obj.get("gpu")
    if value is None:
        return None
    if isinstance(value, str):
        return check_label(value, "gpu")
    return check_int(value, "gpu")
