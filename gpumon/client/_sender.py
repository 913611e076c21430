"""The background half of the hook: turns buffered steps into datagrams and sends them.

The training thread only appends tuples to a bounded deque; this thread drains it every
``FLUSH_INTERVAL_S``, resolves CUDA events once the GPU has passed them, encodes records,
packs them into datagrams and sends them without blocking, counting every loss by reason.
"""

from __future__ import annotations

import math
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from time import perf_counter
from typing import Any

from gpumon.client._cuda import CudaClock, Mark, MemoryTuple
from gpumon.client.transport import Transport
from gpumon.wire import (
    MAX_FLOPS,
    MAX_INT,
    MAX_PHASES,
    ProtocolError,
    encode_measured_field,
    encode_record,
    pack_datagrams,
)

FLUSH_INTERVAL_S = 0.25
"""How often buffered records are sent: inside the 1 s a record may take to arrive, even when
it waits ``EVENT_DEADLINE_S`` for CUDA events. Each flush wakes a thread that shares the
training loop's GIL; at 0.1 s the sender used ~30 % more CPU for the same records."""
EVENT_DEADLINE_S = 0.5
"""A step whose CUDA events the GPU has not reached by then is sent with host-clock phases
(a hung GPU must not hide the last steps before the hang)."""

StepTuple = tuple[
    int,  # sequence number, counts every completed step
    "int | None",  # the caller's step number
    float,  # perf_counter at the start of the step's window
    float,  # perf_counter at its end
    dict[str, float],  # host-clock phase seconds
    Any,  # samples
    Any,  # tokens
    Any,  # flops
    "MemoryTuple | Mapping[str, int] | None",  # from CUDA, else as given to step(memory=)
    "list[Mark] | None",
    "dict[str, object] | None",  # measured fields the monitor's extensions added (comm, memb)
]

FLUSH_BUDGET_S = 0.05
"""How long one background flush keeps retrying a busy agent before leaving the rest for later."""
CLOSE_BUDGET_S = 1.0
"""The same at close, after which what is left is dropped and counted."""
BUSY_RETRY_S = 0.002
MAX_BACKLOG_RECORDS = 4096
"""Records kept for a busy agent; beyond that the oldest are dropped and counted."""
MAX_PHASE_TEMPLATES = 64
"""Distinct sequences of phase names kept formatted; code whose names change every step
starts over at this many."""

_MEM_KEYS = frozenset({"allocated", "reserved", "peak", "retries", "ooms"})
_MEM_FORMAT = ',"mem":{{"allocated":{:d},"reserved":{:d},"peak":{:d},"retries":{:d},"ooms":{:d}}}'


class Sender:
    """Owns the transport and the counters; runs one daemon thread until ``close``."""

    def __init__(
        self,
        transport: Transport,
        step_header: dict[str, object],
        hello: dict[str, object],
        buffer: deque[StepTuple],
    ) -> None:
        self.transport = transport
        self.hello = hello
        self._step_header = step_header
        self._step_head = _step_head(step_header)
        self._phase_templates: dict[tuple[str, ...], str] = {}
        self.clock: CudaClock | None = None
        self.records_sent = 0
        self.datagrams_sent = 0
        self.invalid_fields = 0
        self.dropped: dict[str, int] = {}
        self._buffer = buffer
        self._control: deque[dict[str, object]] = deque(maxlen=256)
        self._waiting: deque[StepTuple] = deque()
        self._backlog: deque[tuple[bytes, int]] = deque()  # datagrams the agent could not take yet
        self._backlog_records = 0
        self._next_seq = 0
        self._agent_lost = False
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpumon-sender", daemon=True)
        self._thread.start()

    def set_gpu(self, gpu: str | int) -> None:
        """Report ``gpu`` on every later record."""
        self.hello = {**self.hello, "gpu": gpu}
        self._step_head = _step_head({**self._step_header, "gpu": gpu})

    def add_control(self, record: dict[str, object]) -> None:
        """Queue a hello or event record for the next flush."""
        self._control.append(record)

    def close(self) -> None:
        """Stop the thread and send what is left (waiting briefly for pending CUDA events)."""
        if os.getpid() != self._pid or self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        deadline = perf_counter() + EVENT_DEADLINE_S
        self.flush()
        while self._waiting and perf_counter() < deadline:
            time.sleep(0.01)
            self.flush()
        self.flush(final=True)
        self.transport.close()

    def flush(self, final: bool = False) -> None:
        """Send everything ready now; ``final`` also sends steps still waiting on CUDA
        events and gives up on what the agent cannot take."""
        with self._lock:
            try:
                self._flush(final)
            except Exception:  # a bug here must cost records, never the training run
                self._count_drop("internal_error", 1)

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self.flush()

    def _flush(self, final: bool) -> None:
        now = perf_counter()
        unix_offset = time.time() - now
        records: list[bytes] = []
        while self._control:
            try:
                records.append(encode_record(self._control.popleft()))
            except (TypeError, ValueError):
                self._count_drop("unencodable", 1)
        for _ in range(len(self._buffer)):
            item = self._buffer.popleft()
            if item[0] > self._next_seq:  # the bounded buffer overwrote the oldest steps
                self._count_drop("buffer_full", item[0] - self._next_seq)
            self._next_seq = item[0] + 1
            self._waiting.append(item)
        while self._waiting:
            item = self._waiting[0]
            phases, marks = item[4], item[9]
            if marks and self.clock is not None:
                gpu_phases = self.clock.resolve(marks)
                if gpu_phases is None and not final and now - item[3] < EVENT_DEADLINE_S:
                    break  # the GPU has not got there yet; later steps are behind it
                if gpu_phases:
                    phases = {**phases, **gpu_phases}
            self._waiting.popleft()
            records.append(self._encode_step(item, phases, unix_offset).encode())
        self._send(records, CLOSE_BUDGET_S if final else FLUSH_BUDGET_S)
        if final:
            while self._backlog:
                self._count_drop("agent_busy", self._backlog.popleft()[1])

    def _encode_step(self, item: StepTuple, phases: dict[str, float], unix_offset: float) -> str:
        # Formatted by hand rather than through json: this is most of the sender's cost per
        # step. Safe because every string in it is a validated label (run and phase names)
        # or was encoded by json (the header), and every number is checked finite here.
        seq, step, t0, t1, _, samples, tokens, flops, mem, _, measured = item
        duration = t1 - t0
        if step is None:
            step = seq
        elif not (type(step) is int and 0 <= step <= MAX_INT):
            self.invalid_fields += 1
            step = seq
        text = self._step_head % (step, t0 + unix_offset, duration)
        if phases:
            text += self._phases_field(phases, duration)
        if samples is not None:
            text += self._count_field("samples", samples)
        if tokens is not None:
            text += self._count_field("tokens", tokens)
        if flops is not None:
            text += self._flops_field(flops)
        if type(mem) is tuple:
            try:
                text += _MEM_FORMAT.format(*mem)
            except (TypeError, ValueError, IndexError):
                self.invalid_fields += 1
        elif mem is not None:
            text += self._memory_field(mem)
        if measured:
            text += self._measured_fields(measured, duration)
        return text + "}"

    def _measured_fields(self, measured: dict[str, object], duration: float) -> str:
        """What extensions measured, each field checked as the agent checks it: one it would
        refuse is left out (and counted) rather than costing the whole record."""
        text = ""
        for name, value in measured.items():
            try:
                text += encode_measured_field(name, value, duration)
            except (ProtocolError, TypeError, ValueError):
                self.invalid_fields += 1
        return text

    def _phases_field(self, phases: dict[str, float], duration: float) -> str:
        """The ``phases`` field, through one cached template per sequence of phase names."""
        names = tuple(phases)
        template = self._phase_templates.get(names) or self._phase_template(names)
        if template is None:  # more phases than a record takes: the last fold into "other"
            return ',"phases":{' + ",".join(f'"{k}":{v:.9g}' for k, v in _fit_phases(phases, duration)) + "}"
        seconds = tuple(phases.values())
        total = sum(seconds)  # NaN if any is NaN, which fails total == total
        if not (total == total and min(seconds) >= 0.0 and max(seconds) <= duration):
            # GPU time of a phase can exceed the host window of its step when the CPU ran ahead.
            seconds = tuple([_clamp(value, duration) for value in seconds])
        return template % seconds

    def _phase_template(self, names: tuple[str, ...]) -> str | None:
        """The ``phases`` field with a ``%.9g`` slot per phase, for up to MAX_PHASES names."""
        if len(names) > MAX_PHASES:
            return None
        if len(self._phase_templates) >= MAX_PHASE_TEMPLATES:
            self._phase_templates.clear()  # phase names that change every step: rare, bounded
        template = ',"phases":{' + ",".join(f'"{name}":%.9g' for name in names) + "}"
        self._phase_templates[names] = template
        return template

    def _memory_field(self, mem: Any) -> str:
        """The ``mem`` field from statistics the caller gave ``step(memory=)``."""
        if not isinstance(mem, Mapping):
            self.invalid_fields += 1
            return ""
        parts = []
        for key, value in mem.items():
            count = _as_count(value) if key in _MEM_KEYS else None
            if count is None:
                self.invalid_fields += 1
            else:
                parts.append(f'"{key}":{count}')
        return ',"mem":{' + ",".join(parts) + "}" if parts else ""

    def _count_field(self, key: str, value: Any) -> str:
        count = value if type(value) is int and 0 <= value <= MAX_INT else _as_count(value)
        if count is None:
            self.invalid_fields += 1
            return ""
        return f',"{key}":{count}'

    def _flops_field(self, value: Any) -> str:
        number = value if type(value) is float and 0.0 <= value <= MAX_FLOPS else _as_flops(value)
        if number is None:
            self.invalid_fields += 1
            return ""
        return f',"flops":{number!r}'

    def _send(self, encoded: list[bytes], budget_s: float) -> None:
        backlog = self._backlog
        backlog.extend(pack_datagrams(encoded))
        deadline = perf_counter() + budget_s
        while backlog:
            datagram, count = backlog[0]
            try:
                reason = self.transport.send(datagram)
            except Exception:
                reason = "send_error"
            if reason == "agent_busy":
                # The agent's queue is full (a burst, or a slow agent): retry shortly, then
                # keep the rest for the next flush. Only this thread waits, never training.
                if perf_counter() < deadline:
                    time.sleep(BUSY_RETRY_S)
                    continue
                break
            backlog.popleft()
            if reason is None:
                self.records_sent += count
                self.datagrams_sent += 1
                if self._agent_lost:  # a (re)started agent has not seen this rank's hello
                    self._agent_lost = False
                    self._control.append(self.hello)
            else:
                self._count_drop(reason, count)
                self._agent_lost = self._agent_lost or reason == "no_agent"
        self._backlog_records = sum(count for _, count in backlog)
        while self._backlog_records > MAX_BACKLOG_RECORDS:
            _, count = backlog.popleft()
            self._backlog_records -= count
            self._count_drop("agent_busy", count)

    def _count_drop(self, reason: str, count: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count


def _step_head(header: dict[str, object]) -> str:
    """A step record's start: its constant fields, then slots for the step number, start
    (Unix seconds) and duration; the record is open for more fields (no closing brace)."""
    prefix = encode_record(header).decode()[:-1].replace("%", "%%")
    return prefix + ',"step":%d,"t_start":%.6f,"duration":%.9g'


def _fit_phases(phases: Mapping[str, float], duration: float) -> Iterable[tuple[str, float]]:
    """Phases as the agent accepts them: finite, none longer than the step, at most MAX_PHASES."""
    # GPU time of a phase can exceed the host window of its step when the CPU ran ahead.
    fitted = [
        (name, seconds if 0.0 <= seconds <= duration else _clamp(seconds, duration))
        for name, seconds in phases.items()
    ]
    if len(fitted) > MAX_PHASES:
        kept = fitted[: MAX_PHASES - 1]
        rest = sum(seconds for _, seconds in fitted[MAX_PHASES - 1 :])
        rest += sum(seconds for name, seconds in kept if name == "other")
        fitted = [(name, seconds) for name, seconds in kept if name != "other"]
        fitted.append(("other", min(rest, duration)))
    return fitted


def _clamp(seconds: float, duration: float) -> float:
    return min(seconds, duration) if seconds >= 0.0 else 0.0  # NaN fails both comparisons


def _as_count(value: Any) -> int | None:
    """A Python or NumPy integer as an int in range, else None (bools and tensors too)."""
    if type(value) is not int:
        if isinstance(value, bool) or type(value).__module__.startswith("torch"):
            return None  # reading a tensor would synchronise with the GPU
        try:
            value = operator.index(value)
        except TypeError:
            return None
    return value if 0 <= value <= MAX_INT else None


def _as_flops(value: Any) -> float | None:
    """A real number as a finite float in range, else None (bools and tensors too)."""
    if isinstance(value, bool) or type(value).__module__.startswith("torch"):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) and 0 <= number <= MAX_FLOPS else None
