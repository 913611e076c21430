"""The full check of the records a process sends beside its steps: ``event``, ``hello``,
``state`` and ``span`` (docs/architecture.md §6); ``decode.decode_record`` dispatches here."""

from __future__ import annotations

from collections.abc import Mapping

from gpumon.wire.fields import (
    check_gpu,
    check_identity,
    check_int,
    check_label,
    check_number,
    check_parallel,
    opt_int,
    opt_number,
    opt_text,
    required,
)
from gpumon.wire.limits import (
    MAX_COLLECTIVE_CHARS,
    MAX_FRAME_TEXT_CHARS,
    MAX_MESSAGE_CHARS,
    MAX_STACK_FRAMES,
    is_label,
)
from gpumon.wire.records import (
    RANK_STATES,
    SPAN_KINDS,
    EventRecord,
    HelloRecord,
    InFlight,
    ProtocolError,
    SpanRecord,
    StackFrame,
    StateRecord,
)


def check_event(obj: Mapping[str, object]) -> EventRecord:
    run, rank, _, _ = check_identity(obj)
    return EventRecord(
        run=run,
        rank=rank,
        event=check_label(required(obj, "event"), "event"),
        t=opt_number(obj, "t"),
        step=opt_int(obj, "step"),
        pid=opt_int(obj, "pid"),
        gpu=check_gpu(obj),
        message=opt_text(obj, "message", MAX_MESSAGE_CHARS),
    )


def check_hello(obj: Mapping[str, object]) -> HelloRecord:
    run, rank, world, local_rank = check_identity(obj)
    version = obj.get("client_version")
    framework = obj.get("framework")
    return HelloRecord(
        run=run,
        rank=rank,
        world=world,
        local_rank=local_rank,
        pid=opt_int(obj, "pid"),
        gpu=check_gpu(obj),
        client_version=None if version is None else check_label(version, "client_version"),
        framework=None if framework is None else check_label(framework, "framework"),
        zero_stage=opt_int(obj, "zero_stage"),
        parallel=None if obj.get("parallel") is None else check_parallel(obj["parallel"]),
    )


def check_state(obj: Mapping[str, object]) -> StateRecord:
    run, rank, _, _ = check_identity(obj)
    state = obj.get("state")
    if state is None:
        raise ProtocolError("missing_field", "state")
    if state not in RANK_STATES:
        raise ProtocolError("bad_state", "state")
    t = check_number(required(obj, "t"), "t")
    steps = check_int(required(obj, "steps"), "step")
    since = opt_number(obj, "since")
    threshold = opt_number(obj, "threshold")
    phase = obj.get("phase")
    flight = obj.get("flight")
    return StateRecord(
        run=run, rank=rank, state=str(state), t=t, steps=steps, since=since, threshold_s=threshold,
        pid=opt_int(obj, "pid"),
        phase=None if phase is None else check_label(phase, "phase"),
        launched=opt_int(obj, "launched"),
        in_flight=None if flight is None else _check_flight(flight),
        stack=_check_stack(obj.get("stack")),
    )


def check_span(obj: Mapping[str, object]) -> SpanRecord:
    run, rank, _, _ = check_identity(obj)
    span = required(obj, "span")
    if span not in SPAN_KINDS:
        raise ProtocolError("bad_span", "span")
    ok = obj.get("ok")
    pending = obj.get("pending", False)
    if (ok is not None and type(ok) is not bool) or type(pending) is not bool:
        raise ProtocolError("bad_span", "ok or pending")
    if pending and (span != "save" or ok is not None):
        raise ProtocolError("bad_span", "only a save may be pending, without an outcome")
    if span == "saved" and ok is None:
        raise ProtocolError("bad_span", "a saved record says how the save ended")
    api = obj.get("api")
    return SpanRecord(
        run=run, rank=rank, span=str(span),
        seconds=check_number(required(obj, "seconds"), "seconds"),
        ok=ok, steps=opt_int(obj, "steps", "step"),
        api=None if api is None else check_label(api, "api"),
        bytes=opt_int(obj, "bytes"), pending=pending, t=opt_number(obj, "t"),
        pid=opt_int(obj, "pid"),
    )


def _check_flight(value: object) -> InFlight:
    if not isinstance(value, dict):
        raise ProtocolError("bad_state", "flight")
    op = value.get("op")
    if not isinstance(op, str) or not is_label(op, MAX_COLLECTIVE_CHARS):
        raise ProtocolError("bad_state", "flight.op")
    device = value.get("device", False)
    if type(device) is not bool:
        raise ProtocolError("bad_state", "flight.device")
    return InFlight(op, check_int(value.get("seq"), "flight.seq"),
                    check_int(value.get("bytes"), "flight.bytes"),
                    check_number(value.get("since"), "flight.since"), device)


def _check_stack(value: object) -> tuple[StackFrame, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STACK_FRAMES:
        raise ProtocolError("bad_stack", f"not a list of at most {MAX_STACK_FRAMES} frames")
    frames = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 4 and type(item[3]) is bool):
            raise ProtocolError("bad_stack", "expected [file, line, function, own]")
        file, line, function, own = item
        frames.append(StackFrame(_frame_text(file), check_int(line, "frame.line"),
                                 _frame_text(function), own))
    return tuple(frames)


def _frame_text(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_FRAME_TEXT_CHARS:
        raise ProtocolError("bad_stack", "file or function")
    if not value.isprintable():
        raise ProtocolError("bad_stack", "unprintable file or function")
    return value
