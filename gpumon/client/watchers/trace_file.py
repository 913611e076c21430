"""A traced rank's file: the profiler's Chrome trace with gpumon's own ranges put in (its steps,
phases and records, matched to the step records the rank sent), gzip'd, written whole or not at all.
"""

from __future__ import annotations

import dataclasses
import errno
import gzip
import json
import os
import re
import tempfile
import time
from time import perf_counter
from typing import Any, NamedTuple

from gpumon.wire import StepRecord

MATCH_WINDOW_S = 0.05
MATCH_SLACK_S = 0.005
DATA_SLACK_S = 0.0005
"""How far past the step's begin a wait for input placed at its window's start may reach
(the core stamps the begin just before the extensions are called)."""
PROBE_BYTES = 1 << 20
_TRACE_EVENTS = re.compile(rb'"traceEvents"\s*:\s*\[')


class TracedStep(NamedTuple):
    """One profiled step on ``perf_counter``'s clock."""

    seq: int
    enter: float
    """When its extensions were called: the core stamped the step's begin just before."""
    begin: float
    """When its ``gpumon.step`` range began (the middle of two readings around it)."""
    end: float
    """When its range ended."""
    left: float = 0.0
    """When its extensions returned (the profiler stopped, on the last): the core stamps the
    step's end just after."""
    origin: float | None = None
    """The core's own reading its record starts from (the step's begin, or the timed work
    before it), so its record's window is ``[origin, origin + duration]``; without it,
    ``[left - duration, left]``, which a thread switch before ``left`` is read can shift."""


def unix_offset() -> float:
    """``time.time()`` less ``perf_counter()``: the largest of a few readings, since a thread
    switch between the two calls makes the difference smaller, never larger."""
    return max(time.time() - perf_counter() for _ in range(5))


def step_number(records: list[StepRecord], first: TracedStep) -> int:
    """The number of the first traced step, for the file's name: its record's, where one is
    matched, else the core's count."""
    match = _matching(records, first, unix_offset())
    return first.seq if match is None else int(match.step)


def _matching(records: list[StepRecord], step: TracedStep,
              unix_offset: float) -> StepRecord | None:
    """The record of a traced step: the one numbered as the core counted it (the number a loop
    gets when it gives none), else the nearest by its end whose duration is the step's own,
    with or without a wait for input before it (a record's unix times are only as good as the
    sender's reading of two clocks, which a thread switch may part by milliseconds)."""
    own = step.left - step.enter
    end = step.left + unix_offset
    numbered = [r for r in records if r.step == step.seq]  # a loop that numbers no steps: its count
    if len(numbered) == 1 and abs(numbered[0].duration_s - own) <= own + MATCH_SLACK_S:
        return numbered[0]

    def misfit(record: StepRecord) -> float:
        data = (record.phases_s or {}).get("data", 0.0)
        return min(abs(record.duration_s - own), abs(record.duration_s - data - own))

    def distance(record: StepRecord) -> float:
        return abs((record.t_start or 0.0) + record.duration_s - end)

    near = sorted((r for r in records if r.t_start is not None and distance(r) <= MATCH_WINDOW_S),
                  key=distance)
    return next((r for r in near if misfit(r) <= MATCH_SLACK_S), None)


def write_trace(prof: Any, path: str, steps: list[TracedStep],
                ranges: list[tuple[str, float, float]], records: list[StepRecord], rank: int,
                world: int | None) -> int:
    """Export ``prof``, add gpumon's ranges, write ``path`` (gzip, 0600); returns its size."""
    directory = os.path.dirname(path)
    fd, raw = tempfile.mkstemp(prefix=".gpumon-trace-", suffix=".json", dir=directory)
    os.close(fd)
    try:
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as exported:
            text = exported.read()
        if not (text.rstrip().endswith(b"}") and _TRACE_EVENTS.search(text)):
            # The profiler does not say when its write failed: write as much ourselves, and
            # the file system's refusal (a full disk, a quota) names the reason.
            with open(raw, "ab") as probe:
                probe.write(bytes(PROBE_BYTES))
                probe.flush()
                os.fsync(probe.fileno())
            raise OSError(errno.EIO, "the profiler wrote an incomplete trace")
    finally:
        for leftover in (raw, raw + ".tmp"):  # the profiler writes the second, then renames it
            if os.path.lexists(leftover):
                os.unlink(leftover)
    events = _gpumon_events(text, steps, ranges, records)
    text = _insert(text, events, rank, world)
    fd, tmp = tempfile.mkstemp(prefix=".gpumon-trace-", suffix=".gz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out, gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6,
                                                       mtime=0) as gz:
            gz.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return os.path.getsize(path)


def _gpumon_events(text: bytes, steps: list[TracedStep],
                   ranges: list[tuple[str, float, float]], records: list[StepRecord]) -> list[dict[str, Any]]:
    """gpumon's phase ranges (``gpumon.<phase>``) and the timed collectives (``gpumon.comm.<kind>``),
    placed on the trace's clock through the first step's own range."""
    if not steps:
        return []
    anchors = [(a, step) for step in steps if (a := _anchor(text, step.seq)) is not None]
    if not anchors:
        return []
    _, pid, tid = anchors[0][0]
    # Each step's range began between two clock readings: the trace's clock is ours plus
    # the median of their offsets (one slow first call cannot move it).
    offsets = sorted(a[0] - step.begin * 1e6 for a, step in anchors)
    offset_us = offsets[len(offsets) // 2]

    def event(name: str, t0: float, t1: float, args: dict[str, Any]) -> dict[str, Any]:
        return {"ph": "X", "cat": "gpumon", "name": name, "pid": pid, "tid": tid,
                "ts": round(t0 * 1e6 + offset_us, 3), "dur": round(max(t1 - t0, 0.0) * 1e6, 3),
                "args": args}

    out: list[dict[str, Any]] = []
    first, last = steps[0].begin, steps[-1].end
    offset = unix_offset()
    for name, t0, t1 in ranges:
        if t0 >= first - 1e-4 and t1 <= last + 1e-4:
            out.append(event(f"gpumon.{name}", t0, t1, {"phase": name}))
    for step in steps:
        record = _matching(records, step, offset)
        if record is None:
            continue
        args = {"step": record.step, "seq": step.seq}
        start = step.origin if step.origin is not None else step.left - record.duration_s
        data = (record.phases_s or {}).get("data")
        # A wait for input before the step (the loader's, a DataLoader's under `gpumon run`)
        # opens its window: it lies at the start. A data phase timed inside the step has no
        # stamps and is left to the record's figures below.
        if data and start + data <= step.enter + DATA_SLACK_S:
            out.append(event("gpumon.data", start, start + data, {"phase": "data", **args}))
        # The step as gpumon recorded it: its window, phase seconds and the collectives
        # watch() timed (exposed and in-flight seconds, count, bytes and seconds per kind).
        figures: dict[str, Any] = {"phases": dict(record.phases_s or {}), "duration_s": record.duration_s}
        comm = record.comm
        if comm is not None:
            figures["comm"] = {"exposed_s": comm.exposed_s, "busy_s": comm.busy_s,
                               "ops": [list(dataclasses.astuple(op)) for op in comm.ops]}
        out.append(event("gpumon.record", start, start + record.duration_s, {**figures, **args}))
    return out


def _anchor(text: bytes, seq: int) -> tuple[float, Any, Any] | None:
    """The first traced step's range in the exported trace: (ts, pid, tid)."""
    name = f'"gpumon.step {seq}"'.encode()
    at = text.find(name)
    if at < 0:
        return None
    start = text.rfind(b"{", 0, at)
    try:
        event, _ = json.JSONDecoder().raw_decode(text[start:at + 4096].decode("utf-8", "replace"))
    except ValueError:
        return None
    return float(event["ts"]), event.get("pid"), event.get("tid")


def _insert(text: bytes, events: list[dict[str, Any]], rank: int, world: int | None) -> bytes:
    """``text`` with ``events`` first in its ``traceEvents`` and, when torch left it out
    (no process group), ``distributedInfo`` naming the rank (what trace tools group by)."""
    match = _TRACE_EVENTS.search(text)
    if match is not None and events:
        added = b",".join(json.dumps(e).encode() for e in events) + b","
        text = text[:match.end()] + added + text[match.end():]
    if b'"distributedInfo"' not in text[:4096]:
        info = json.dumps({"rank": rank, "world_size": world or 1}).encode()
        brace = text.find(b"{")
        text = text[:brace + 1] + b'"distributedInfo": ' + info + b"," + text[brace + 1:]
    return text
