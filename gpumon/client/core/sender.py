"""The background half of the hook: turns buffered steps into datagrams and sends them.

The training thread only appends tuples to a bounded deque; this thread drains it every
``FLUSH_INTERVAL_S``, resolves CUDA events once the GPU has passed them, encodes records
(steps through the wire package's ``StepEncoder``, the common ones written by ``_hook``'s
``format_step`` in C where it was built; hellos and events through ``encode_record``), packs
them into datagrams and sends them without blocking, counting every loss by reason. What
the agent cannot take yet (absent, restarting, busy) waits in a bounded backlog
(``backlog.py``) and goes first once it answers. Where the process keeps a step ring
(``ring.py``), this thread hands its descriptor to the agent (again after the agent was
lost) and marks in it how far the steps were sent, so that the agent, should the process die,
takes from the ring only what it had not received.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import Any

from gpumon.client.core.backlog import Backlog
from gpumon.client.core.cuda_clock import CudaClock
from gpumon.client.core.ring import StepRing
from gpumon.client.core.step_tuple import (
    FLOPS,
    MARKS,
    MEASURED,
    MEMORY,
    PHASES,
    SAMPLES,
    SEQ,
    STEP,
    T0,
    T1,
    TOKENS,
    StepTuple,
)
from gpumon.client.core.transport import Transport
from gpumon.wire import (
    EventRecord,
    HelloRecord,
    SpanRecord,
    StateRecord,
    StepEncoder,
    encode_record,
    pack_datagrams,
)
from gpumon.wire.ring import handover
from gpumon.wire.step_encoder import LIMITS, Formatter


def _c_formatter() -> Formatter | None:
    """``_hook.format_step``, told the wire's limits; None where it was not built (or
    ``GPUMON_PURE_PYTHON=1``): ``StepEncoder`` then writes every record itself."""
    if os.environ.get("GPUMON_PURE_PYTHON"):
        return None
    try:
        from gpumon.client.core._hook import format_step, set_step_limits
    except ImportError:
        return None
    set_step_limits(*LIMITS)
    formatter: Formatter = format_step
    return formatter


_formatter = _c_formatter()

FLUSH_INTERVAL_S = 0.25
"""How often buffered records are sent: inside the 1 s a record may take to arrive, even when
it waits ``EVENT_DEADLINE_S`` for CUDA events. Each flush wakes a thread that shares the
training loop's GIL; at 0.1 s the sender used ~30 % more CPU for the same records."""
EVENT_DEADLINE_S = 0.5
"""A step whose CUDA events the GPU has not reached by then is sent with host-clock phases
(a hung GPU must not hide the last steps before the hang)."""

FLUSH_BUDGET_S = 0.05
"""How long one background flush keeps retrying a busy agent before leaving the rest for later."""
CLOSE_BUDGET_S = 1.0
"""The same at close, after which what is left is dropped and counted."""
BUSY_RETRY_S = 0.002
GIL_YIELD_RECORDS = 32
"""The sender holds the GIL while it encodes. Every so many records it lets go of it, so that
a training thread coming back from a torch op waits at most that long (~0.1 ms), not for a
whole flush of a busy loop's records, nor the interpreter's 5 ms switch interval."""
HOLD_FOR = frozenset({"agent_busy", "no_agent"})
"""Send failures after which a datagram waits in the backlog: the agent may take it later."""


class Sender:
    """Owns the transport and the counters; runs one daemon thread until ``close``."""

    def __init__(self, transport: Transport, hello: HelloRecord, buffer: deque[StepTuple],
                 backlog: Backlog | None = None, ring: StepRing | None = None) -> None:
        """Send ``buffer``'s steps under ``hello``'s identity (its run, rank, world, local
        rank, pid and GPU); the caller queues ``hello`` itself when it is complete. ``ring``:
        the process's step ring, handed to the agent and marked as steps are sent."""
        self.transport = transport
        self.hello = hello
        self._encoder = StepEncoder(hello.run, hello.rank, hello.world, hello.local_rank, hello.pid,
                                    hello.gpu, _formatter)
        self.clock: CudaClock | None = None
        self.records_sent = 0
        self.deferred_missed = 0  # GPU-timed fields left out: events not passed in time
        self.datagrams_sent = 0
        self.state_sent = 0
        self.state_lost = 0
        self.dropped: dict[str, int] = {}
        self._buffer = buffer
        self._control: deque[HelloRecord | EventRecord | SpanRecord] = deque(maxlen=256)
        self.on_wake: Callable[[], None] | None = None
        """Called on this thread before each background flush (the stall watch)."""
        self._waiting: deque[StepTuple] = deque()
        self.backlog = Backlog() if backlog is None else backlog
        self._held_for = "agent_busy"  # why the backlog's datagrams wait
        self.ring = ring
        self._ring_handed = False  # the agent holds the ring's descriptor
        self.rings_handed = 0
        self._next_seq = 0
        self._agent_lost = False
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpumon-sender", daemon=True)
        self._thread.start()

    @property
    def invalid_fields(self) -> int:
        """Step fields left out because the agent would have refused them."""
        return self._encoder.invalid_fields

    def set_gpu(self, gpu: str | int) -> None:
        """Report ``gpu`` on every later record."""
        self.hello = dataclasses.replace(self.hello, gpu=gpu)
        self._encoder.set_gpu(gpu)

    def add_control(self, record: HelloRecord | EventRecord | SpanRecord) -> None:
        """Queue a hello, event or span record for the next flush (from any thread)."""
        self._control.append(record)

    def send_state(self, record: StateRecord) -> None:
        """Send a ``state`` record now, in a datagram of its own. A liveness signal, not
        data: never queued or retried (the next one follows within seconds), and counted
        apart from the records (``state_sent``, ``state_lost``)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            try:
                reason = self.transport.send(b"[" + encode_record(record) + b"]")
            except Exception:
                reason = "send_error"
            if reason is None:
                self.state_sent += 1
            else:
                self.state_lost += 1

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
            on_wake = self.on_wake
            if on_wake is not None:
                try:
                    on_wake()
                except Exception:  # a bug here must cost the watch, never the records
                    self._count_drop("internal_error", 1)
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
        controls = len(records)  # the records before the steps
        seq_ends: list[int] = []  # per step record: its sequence number + 1
        for _ in range(len(self._buffer)):
            item = self._buffer.popleft()
            seq = item[SEQ]
            if seq > self._next_seq:  # the bounded buffer overwrote the oldest steps
                self._count_drop("buffer_full", seq - self._next_seq)
            self._next_seq = seq + 1
            self._waiting.append(item)
        while self._waiting:
            item = self._waiting[0]
            phases, marks, measured = item[PHASES], item[MARKS], item[MEASURED]
            late = final or now - item[T1] >= EVENT_DEADLINE_S
            deferred = _deferred(measured)
            if deferred and not late and not all(field.ready() for field in deferred.values()):
                break  # the GPU has not got there yet; later steps are behind it
            gpu_phases = None
            if marks and self.clock is not None:
                gpu_phases = self.clock.resolve(marks)
                if gpu_phases is None and not late:
                    break
                if gpu_phases:
                    phases = {**phases, **gpu_phases}
            if deferred:
                measured = self._resolve(measured, deferred)
            self._waiting.popleft()
            records.append(self._encode_step(item, phases, unix_offset, gpu_phases or (), measured).encode())
            seq_ends.append(item[SEQ] + 1)
            if not len(records) % GIL_YIELD_RECORDS:
                time.sleep(0)  # the GIL, to a training thread back from a torch op and waiting for it
        if self.ring is not None:
            self.ring.set_unix_offset(unix_offset)
        self._send(records, controls, seq_ends, CLOSE_BUDGET_S if final else FLUSH_BUDGET_S)
        if final and self.backlog:
            self._count_drop(self._held_for, self.backlog.clear())

    def _resolve(self, measured: dict[str, object] | None,
                 deferred: dict[str, Any]) -> dict[str, object] | None:
        """``measured`` with each ``Deferred`` field replaced by its value, or left out (and
        counted) where the GPU did not reach its events in time or the value is missing."""
        resolved = dict(measured or {})
        for key, field in deferred.items():
            del resolved[key]
            if field.ready():
                value = field.value()
            else:
                field.abandon()
                value = None
            if value is None:
                self.deferred_missed += 1
            else:
                resolved[key] = value
        return resolved or None

    def _encode_step(self, item: StepTuple, phases: dict[str, float], unix_offset: float,
                     device_phases: Iterable[str], measured: dict[str, object] | None) -> str:
        t0 = item[T0]
        return self._encoder.encode(item[STEP], item[SEQ], t0 + unix_offset, item[T1] - t0, phases,
                                    item[SAMPLES], item[TOKENS], item[FLOPS], item[MEMORY], measured,
                                    device_phases)

    def _send(self, encoded: list[bytes], controls: int, seq_ends: list[int], budget_s: float) -> None:
        backlog = self.backlog
        datagrams = pack_datagrams(encoded)
        backlog.add(datagrams, _marks(datagrams, controls, seq_ends))
        deadline = perf_counter() + budget_s
        if self.ring is not None and not self._ring_handed:
            self._hand_ring(self.ring)
        while backlog:
            datagram, count = backlog.head()
            try:
                reason = self.transport.send(datagram)
            except Exception:
                reason = "send_error"
            if reason in HOLD_FOR:
                # The agent's queue is full (a burst, a slow agent) or nobody listens (the
                # agent restarts): retry a busy one shortly, then keep the rest, in order, for
                # the next flush. Only this thread waits, never training.
                self._held_for = reason
                if reason == "agent_busy" and perf_counter() < deadline:
                    time.sleep(BUSY_RETRY_S)
                    continue
                self._agent_lost = self._agent_lost or reason == "no_agent"
                if reason == "no_agent":
                    self._ring_handed = False  # a restarted agent holds none
                break
            mark = backlog.pop(sent=reason is None)
            if reason is None and mark is not None and self.ring is not None:
                self.ring.mark_sent(mark)
            if reason is None:
                self.records_sent += count
                self.datagrams_sent += 1
                if self._agent_lost:  # a (re)started agent has not seen this rank's hello
                    self._agent_lost = False
                    self._control.append(self.hello)
            else:
                self._count_drop(reason, count)
        dropped = backlog.trim()
        if dropped:
            self._count_drop(self._held_for, dropped)

    def _hand_ring(self, ring: StepRing) -> None:
        """Give the agent the ring's descriptor (a ``ring`` datagram carrying it); tried
        again at the next flush when the agent cannot take it yet."""
        send_fd = getattr(self.transport, "send_fd", None)
        if send_fd is None:
            return
        try:
            reason = send_fd(handover(self.hello.run, self.hello.rank), ring.fd)
        except Exception:
            reason = "send_error"
        if reason is None:
            self._ring_handed = True
            self.rings_handed += 1

    def _count_drop(self, reason: str, count: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count


def _marks(datagrams: list[tuple[bytes, int]], controls: int, seq_ends: list[int]) -> list[int | None]:
    """Per datagram, the sequence number below which its steps (and every earlier one) are
    sent once it is: its last step's, or None when it holds none. The records packed are
    ``controls`` records without a step, then one step record per ``seq_ends`` entry, in
    order: a datagram's last record is its last step, or it holds none (one look a datagram,
    not one a record)."""
    marks: list[int | None] = []
    at = 0
    for _, count in datagrams:
        at += count
        marks.append(seq_ends[at - 1 - controls] if at > controls else None)
    return marks


def _deferred(measured: dict[str, object] | None) -> dict[str, Any]:
    """The fields of ``measured`` the GPU has still to resolve (``Deferred``)."""
    if not measured:
        return {}
    return {key: field for key, field in measured.items() if hasattr(field, "ready")}
