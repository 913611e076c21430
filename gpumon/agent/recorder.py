"""`--record FILE.jsonl`: append every step record and GPU sample the agent sees, and where each
rank's time went (``time`` lines, every ``TIME_LINE_INTERVAL_S`` and at the end).

Step lines are wire records (kind "step"); GPU lines follow the recording format in
docs/architecture.md §6. Writes are buffered and flushed at least every second by the
caller's housekeeping, so a recording costs the ingest path one list append.

A recording must not lose data quietly. A write that fails (a full disk, a quota) keeps what
was not written and tries again at the next flush, so nothing is lost when space comes back
within the backlog's bound; beyond it the oldest whole lines are dropped and counted. A line
cut short by a failed write is finished by the retry, and a session appended to a file whose
last line was torn (an agent killed mid-write) starts on a fresh line. The file is never
reached through a symbolic link, and is created without access for others.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from gpumon.analysis.goodput import CAUSES, TimeTotals
from gpumon.collectors.gpu_fields import GPU_FIELDS
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.errors import GpumonError
from gpumon.state.recording import RecorderStatus
from gpumon.wire import HelloRecord, StepRecord, to_wire
from gpumon.wire.frozen import maker

log = logging.getLogger(__name__)

FILE_MODE = 0o640  # steps name runs and hosts' processes: not for every local user
# Unwritten data kept for a retry: about a minute of 64 ranks at 10 steps/s, and a bound on
# the agent's memory while the disk stays full.
MAX_BACKLOG_BYTES = 16 * 1024 * 1024

# GpuSample field -> recording key.
_GPU_KEYS = tuple((f.name, f.record) for f in GPU_FIELDS if f.record is not None)


def time_line(run: str, rank: int, totals: TimeTotals, unix_of: Callable[[float], float],
              now_t: float) -> dict[str, Any]:
    """Where a rank's time went as a recording line (docs/goodput.md)."""
    return {"kind": "time", "t": round(now_t, 3), "run": run, "rank": rank,
            "goodput": round(totals.goodput_s, 3),
            "badput": {cause: round(seconds, 3) for cause, seconds in totals.badput_s.items()},
            "unsaved": round(totals.unsaved_s, 3), "restarts": totals.restarts,
            "restarted_at": [round(unix_of(t), 3) for t in totals.restarted_at]}


def gpu_line(sample: GpuSample, static: GpuStatic | None = None) -> dict[str, Any]:
    """A GPU sample as a recording line; ``uuid`` and ``model`` let a replay attribute ranks."""
    line: dict[str, Any] = {"kind": "gpu", "t": sample.t, "gpu": sample.index}
    if static is not None:
        line["uuid"] = static.uuid
        line["model"] = static.name
    for field, key in _GPU_KEYS:
        value = getattr(sample, field)
        if value is not None:
            line[key] = value
    if sample.process_memory_bytes:
        line["processes"] = {str(pid): used for pid, used in sample.process_memory_bytes.items()}
    if not sample.up:
        line["up"] = False
    return line


_SAMPLE_FIELDS = {f.name: i for i, f in enumerate(dataclasses.fields(GpuSample))}
_RECORDED = tuple((_SAMPLE_FIELDS[field], key) for field, key in _GPU_KEYS)
_INDEX, _T, _UP, _PROCESSES = (_SAMPLE_FIELDS[name] for name in (
    "index", "t", "up", "process_memory_bytes"))
_UNRECORDED: list[Any] = [None] * len(_SAMPLE_FIELDS)
"""A sample's fields in order, each ``None`` (``GpuSample``'s default but for the three set)."""
assert all(f.default is None or f.name in ("index", "t", "up")
           for f in dataclasses.fields(GpuSample))
_make_sample = maker(GpuSample)


def sample_from_line(line: dict[str, Any]) -> GpuSample:
    """Inverse of :func:`gpu_line` (for replaying recordings). A day's recording holds
    millions: the sample is made from every field in order (``frozen.maker``), the recorded
    ones read from the line, the others their default ``None``."""
    get = line.get
    values = _UNRECORDED.copy()
    for position, key in _RECORDED:
        values[position] = get(key)
    processes = get("processes")
    if isinstance(processes, dict):
        values[_PROCESSES] = {int(pid): int(used) for pid, used in processes.items()}
    values[_INDEX] = int(line["gpu"])
    values[_T] = float(line["t"])
    values[_UP] = get("up", True)
    return _make_sample(*values)


def time_from_line(line: dict[str, Any]) -> tuple[str, int, float, TimeTotals]:
    """Inverse of :func:`time_line`: (run, rank, when, its figures, ``restarted_at`` in unix
    time); raises ``KeyError``, ``TypeError`` or ``ValueError`` on a line that is not one."""
    badput = line["badput"]
    if not isinstance(badput, dict) or set(badput) != set(CAUSES):
        raise ValueError("badput: one figure per cause")
    restarted = line.get("restarted_at", [])
    if not isinstance(restarted, list):
        raise TypeError("restarted_at")
    totals = TimeTotals(float(line["goodput"]), {c: float(badput[c]) for c in CAUSES},
                        float(line["unsaved"]), int(line["restarts"]),
                        restarted_at=tuple(float(t) for t in restarted))
    return str(line["run"]), int(line["rank"]), float(line["t"]), totals


class RecordingError(GpumonError, OSError):
    """The recording file cannot be opened; the message says why."""


class Recorder:
    """Appends lines to a JSONL file; thread-safe, buffered, retrying failed writes."""

    def __init__(self, path: Path, max_backlog_bytes: int = MAX_BACKLOG_BYTES) -> None:
        self.path = path
        self._max_backlog = max_backlog_bytes
        self._lock = threading.Lock()  # the queue, taken by ingest and collectors
        self._write_lock = threading.Lock()  # the file and the backlog, taken by flushes
        self._pending: list[str] = []
        self._backlog = bytearray()  # whole lines not yet written, or the rest of a cut one
        self._mid_line = False  # the file ends inside a line that the backlog finishes
        self._lines_written = self._lines_dropped = self._write_errors = 0
        self._error: str | None = None
        self._failing_since: float | None = None
        self._fd = _open(path)
        self._fresh_line()

    def _fresh_line(self) -> None:
        """Start on a line of our own when the file ends in a torn one (written at the first
        flush: the newline finishes the torn line, as for a line a failed write cut)."""
        try:
            size = os.fstat(self._fd).st_size
            if size == 0:
                return  # also every device and pipe
            reader = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                torn = os.pread(reader, 1, size - 1) != b"\n"
            finally:
                os.close(reader)
        except OSError:
            return  # unreadable to us: appending still works
        if torn:
            self._backlog += b"\n"
            self._mid_line = True

    def steps(self, records: Iterable[StepRecord]) -> None:
        """Queue step records."""
        lines = [json.dumps(to_wire(r), separators=(",", ":")) for r in records]
        with self._lock:
            self._pending.extend(lines)

    def hellos(self, records: Iterable[HelloRecord]) -> None:
        """Queue the hellos that say where a rank sits in its job's parallelism (a replay
        compares each rank with its replicas, as the agent did)."""
        lines = [json.dumps(to_wire(r), separators=(",", ":")) for r in records
                 if r.parallel is not None]
        with self._lock:
            self._pending.extend(lines)

    def times(self, totals: Mapping[tuple[str, int], TimeTotals], unix_of: Callable[[float], float],
              now_t: float) -> None:
        """Queue where each rank's time went so far (a ``time`` line each; the last of a rank
        is its figures; ``restarts`` lists its successors' starts, unix time)."""
        lines = [json.dumps(time_line(run, rank, t, unix_of, now_t), separators=(",", ":"))
                 for (run, rank), t in sorted(totals.items())]
        with self._lock:
            self._pending.extend(lines)

    def gpus(self, samples: Iterable[GpuSample], statics: Iterable[GpuStatic] = ()) -> None:
        """Queue GPU samples."""
        by_index = {s.index: s for s in statics}
        lines = [json.dumps(gpu_line(s, by_index.get(s.index)), separators=(",", ":"))
                 for s in samples]
        with self._lock:
            self._pending.extend(lines)

    def flush(self) -> None:
        """Write what is queued and what earlier writes left; a failure is kept, not raised."""
        with self._lock:
            pending, self._pending = self._pending, []
        with self._write_lock:
            if self._fd < 0:
                return
            if pending:
                self._backlog += ("\n".join(pending) + "\n").encode("utf-8")
                self._lines_written += len(pending)  # taken back below if dropped
            self._write_backlog()
            self._bound_backlog()

    def _write_backlog(self) -> None:
        backlog = self._backlog
        while backlog:
            try:
                written = os.write(self._fd, backlog)
            except InterruptedError:
                continue
            except OSError as exc:
                self._failed(exc)
                return
            if written:
                self._mid_line = backlog[written - 1] != 0x0A
                del backlog[:written]
        if self._error is not None:
            log.warning("recording %s: writing again after %.0f s (%d lines dropped so far)",
                        self.path, time.monotonic() - (self._failing_since or 0.0),
                        self._lines_dropped)
        self._error = self._failing_since = None

    def _failed(self, exc: OSError) -> None:
        self._write_errors += 1
        reason = exc.strerror or str(exc)
        if self._error is None:
            self._failing_since = time.monotonic()
            log.error("recording %s: write failed: %s; keeping up to %g MiB to write when "
                      "it can", self.path, reason, self._max_backlog / 2**20)
        self._error = reason

    def _bound_backlog(self) -> None:
        """Drop the oldest whole lines beyond the bound (never the rest of a cut line)."""
        backlog = self._backlog
        excess = len(backlog) - self._max_backlog
        if excess <= 0:
            return
        keep_from = backlog.index(b"\n") + 1 if self._mid_line else 0
        cut = backlog.find(b"\n", keep_from + excess - 1)  # end of the last line to drop
        cut = len(backlog) - 1 if cut < 0 else cut
        dropped = backlog.count(b"\n", keep_from, cut + 1)
        del backlog[keep_from:cut + 1]
        self._lines_dropped += dropped
        self._lines_written -= dropped

    def status(self) -> RecorderStatus:
        """Counters and the current write failure, if any."""
        with self._write_lock:
            return RecorderStatus(
                path=str(self.path), lines_written_total=self._lines_written - _lines_in(
                    self._backlog, self._mid_line), lines_dropped_total=self._lines_dropped,
                write_errors_total=self._write_errors, backlog_bytes=len(self._backlog),
                error=self._error)

    def close(self) -> None:
        """Flush and close the file; what still cannot be written is said in the log."""
        self.flush()
        with self._write_lock:
            if self._fd < 0:
                return
            if self._backlog:
                log.error("recording %s: %d lines could not be written: %s", self.path,
                          _lines_in(self._backlog, self._mid_line), self._error)
            try:
                os.close(self._fd)
            except OSError as exc:
                log.error("recording %s: closing failed: %s", self.path, exc.strerror or exc)
            self._fd = -1


def _lines_in(backlog: bytearray, mid_line: bool) -> int:
    """Lines in the backlog not written at all (the rest of a cut line counts as written)."""
    return backlog.count(b"\n") - (1 if mid_line and backlog else 0)


def _open(path: Path) -> int:
    """Open for appending: not through a symbolic link, created 0640 (less with the umask)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RecordingError(exc.errno, "it is a symbolic link, and a recording is never "
                                 "written through one") from None
        raise RecordingError(exc.errno, exc.strerror or str(exc)) from None
