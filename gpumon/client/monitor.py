"""``StepMonitor``: times training steps and their phases and reports them to the gpumon agent.

The training thread only reads clocks and appends one tuple per step to a bounded buffer
(a few microseconds); a daemon thread (``_sender``) encodes and sends them. Nothing here
ever blocks the training loop or raises from the transport.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from time import perf_counter, time
from types import TracebackType
from typing import Any, TypeVar

import gpumon
from gpumon.client import _cuda
from gpumon.client._sender import Sender, StepTuple
from gpumon.client.identity import resolve_identity, resolve_socket_path
from gpumon.client.transport import Transport, UnixDatagramTransport
from gpumon.protocol import (
    MAX_GPU_CHARS,
    MAX_GPU_INDEX,
    MAX_LABEL_CHARS,
    MAX_MESSAGE_CHARS,
    PROTOCOL_VERSION,
    is_label,
)

T = TypeVar("T")

BUFFER_STEPS = 4096
"""Steps held for the sender; when it falls behind, the oldest are dropped and counted."""

HOST_CLOCK_PHASES = frozenset({"data"})
"""Phases timed on the host even with CUDA: waiting for input is not GPU work."""

_live_monitors: weakref.WeakSet[StepMonitor] = weakref.WeakSet()


@dataclass(frozen=True, slots=True)
class ClientStats:
    """What a monitor did so far: steps timed, records sent, and records lost by reason."""

    steps: int
    records_sent: int
    datagrams_sent: int
    dropped: dict[str, int] = field(default_factory=dict)
    invalid_fields: int = 0


class StepMonitor:
    """Times each training step and its phases and reports them to the node's gpumon agent.

    Args:
        run: the run's name (1-128 of ``[A-Za-z0-9_.:/-]``); default ``$GPUMON_RUN``, else
            ``"default"``.
        socket_path: the agent's Unix datagram socket; default ``$GPUMON_SOCKET``, else
            ``/run/gpumon/ingest.sock``.
        transport: send through this object instead of the socket (tests, custom sinks).
        rank, world, local_rank: override what is found in ``torch.distributed`` (when it is
            initialised) or the launcher's environment (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``,
            then Slurm's).
        reset_peak_memory: with CUDA, reset the allocator's peak statistic after each step so
            each record carries that step's own peak. Turn it off if your code reads
            ``torch.cuda.max_memory_allocated()`` itself.
        gpu: the device this rank runs on (NVML UUID or index), for code the hook cannot see
            using CUDA through PyTorch (another framework, a simulated job); by default the
            CUDA device in use is reported, once there is one.

    Raises ``ValueError`` for an invalid run name, GPU or inconsistent ranks. After that nothing it
    does raises into the training loop: an absent, slow or restarting agent costs records
    (counted in ``stats``), never time. Records reach the agent within about 0.3 s of their
    step's end; ``close()`` (also called at interpreter exit) sends what is left.
    """

    def __init__(
        self,
        run: str | None = None,
        *,
        socket_path: str | None = None,
        transport: Transport | None = None,
        rank: int | None = None,
        world: int | None = None,
        local_rank: int | None = None,
        reset_peak_memory: bool = True,
        gpu: str | int | None = None,
    ) -> None:
        ident = resolve_identity(run, rank, world, local_rank)
        if gpu is not None and not _valid_gpu(gpu):
            raise ValueError(
                f"gpu={gpu!r}: expected an NVML UUID (1-{MAX_GPU_CHARS} of "
                f"[A-Za-z0-9_.:/-]) or an index below {MAX_GPU_INDEX}"
            )
        self._gpu = gpu
        self.run, self.rank, self.world, self.local_rank = (
            ident.run,
            ident.rank,
            ident.world,
            ident.local_rank,
        )
        self.socket_path = resolve_socket_path(socket_path) if transport is None else None
        if transport is None:
            assert self.socket_path is not None
            transport = UnixDatagramTransport(self.socket_path)
        self._reset_peak = reset_peak_memory
        # Hot-path state, touched only by the training thread.
        self._enabled = True
        self._seq = 0
        self._step_depth = 0
        self._step_t0 = 0.0
        self._pending_t0: float | None = None  # start of timed work before the next step
        self._phases: dict[str, float] = {}
        self._phase_depth = 0
        self._phase_t0 = 0.0
        self._phase_event: Any = None
        self._marks: list[_cuda.Mark] = []
        self._phase_cache: dict[str, _Phase] = {}
        self._cuda: _cuda.CudaClock | None = None
        self._cuda_checked = False
        self._last_ooms: int | None = None
        self._buffer: deque[StepTuple] = deque(maxlen=BUFFER_STEPS)

        identity: dict[str, object] = {"v": PROTOCOL_VERSION, "run": self.run, "rank": self.rank}
        if self.world is not None:
            identity["world"] = self.world
        if self.local_rank is not None:
            identity["local_rank"] = self.local_rank
        identity["pid"] = os.getpid()
        self._sender = Sender(
            transport,
            step_header={**identity, "kind": "step"},
            hello={**identity, "kind": "hello", "client_version": gpumon.__version__},
            buffer=self._buffer,
        )
        if gpu is not None:
            self._sender.set_gpu(gpu)
        self._detect_cuda(final=False)
        self._sender.add_control(self._sender.hello)
        self._finalizer = weakref.finalize(self, self._sender.close)
        _live_monitors.add(self)

    def step(
        self,
        *,
        samples: int | None = None,
        tokens: int | None = None,
        flops: float | None = None,
        step: int | None = None,
        memory: Mapping[str, int] | None = None,
    ) -> _Step:
        """Context manager around one training step.

        Args:
            samples: samples this rank processed in the step (Python int).
            tokens: tokens this rank processed in the step (Python int).
            flops: floating-point operations this rank did in the step (e.g. 6·params·tokens).
            step: the trainer's step number; default: this monitor's count of steps, from 0.
            memory: the step's allocator statistics, for memory the hook cannot read from
                PyTorch's CUDA allocator itself (which, when in use, wins): any of
                ``allocated``, ``reserved`` and ``peak`` (bytes, the peak of this step) and
                the cumulative counts ``retries`` and ``ooms``. Read after the step ends;
                invalid entries are left out and counted in ``stats.invalid_fields``.

        The step's window starts when the loader was asked for its batch (see ``loader``) or
        when a phase was timed before it, else when the block is entered. Pass Python
        numbers: a tensor would have to be read back from the GPU, so it is ignored (and
        counted in ``stats.invalid_fields``). A nested ``step()`` is ignored: only the
        outermost counts. If an exception escapes, the step is not recorded; a torch
        ``OutOfMemoryError`` is reported as an ``oom`` event, and the exception propagates
        unchanged.
        """
        return _Step(self, samples, tokens, flops, step, memory)

    def phase(self, name: str) -> _Phase:
        """Context manager timing part of a step: ``data``, ``forward``, ``backward``,
        ``comm``, ``optimizer``, or any other label (the agent counts those as ``other``).

        With CUDA in use, phases other than ``data`` are timed by CUDA events, read later
        without synchronising. Nested phases: only the outermost is timed. A phase outside a
        step belongs to the next step. Raises ``ValueError`` for a name that is not 1-64 of
        ``[A-Za-z0-9_.:/-]``.
        """
        ctx = self._phase_cache.get(name)
        if ctx is None:
            if not isinstance(name, str) or not is_label(name, MAX_LABEL_CHARS):
                raise ValueError(f"phase name {name!r}: use 1-64 of letters, digits, _ . : / -")
            ctx = self._phase_cache[name] = _Phase(self, name, name in HOST_CLOCK_PHASES)
        return ctx

    def loader(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield ``iterable``'s items, timing each wait as the ``data`` phase of the next step."""
        t0 = perf_counter()
        iterator = iter(iterable)
        while True:
            try:
                item = next(iterator)
            except StopIteration:
                return
            self._data_wait(t0, perf_counter())
            yield item
            t0 = perf_counter()

    @property
    def stats(self) -> ClientStats:
        """A snapshot of the counters."""
        sender = self._sender
        return ClientStats(
            steps=self._seq,
            records_sent=sender.records_sent,
            datagrams_sent=sender.datagrams_sent,
            dropped=dict(sender.dropped),
            invalid_fields=sender.invalid_fields,
        )

    @property
    def gpu(self) -> str | int | None:
        """The device reported: the one given, else the CUDA device (UUID, else index) once
        CUDA is seen in use."""
        if self._gpu is not None:
            return self._gpu
        return None if self._cuda is None else self._cuda.gpu

    def flush(self) -> None:
        """Send buffered records now, from the calling thread, instead of at the next
        background flush (waits for a flush in progress: at most ~50 ms, when the agent is busy)."""
        if self._enabled:
            self._sender.flush()

    def close(self) -> None:
        """Send what is left and stop; later steps are not recorded. Idempotent."""
        if not self._enabled:
            return
        if self._step_depth and self._cuda is not None:
            # A step was left open (an integration without exception hooks): if the
            # allocator counted an OOM since the last step, that is what ended it.
            mem = self._cuda.memory()
            if mem is not None and self._last_ooms is not None and mem[4] > self._last_ooms:
                self._event("oom", "an out-of-memory error ended the last step", self._seq)
        self._enabled = False
        self._finalizer()

    def __enter__(self) -> StepMonitor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- used by the integrations -------------------------------------------------------

    def _data_wait(self, t0: float, t1: float) -> None:
        """Count ``t1 - t0`` (perf_counter) as waiting for input before the next step."""
        if not self._step_depth and self._pending_t0 is None:
            self._pending_t0 = t0
        self._phases["data"] = self._phases.get("data", 0.0) + (t1 - t0)

    def _event(self, name: str, message: str | None, step: int) -> None:
        """Queue an event record (e.g. ``oom``) for the next flush."""
        if not self._enabled:
            return
        record: dict[str, object] = {
            **self._sender.hello,
            "kind": "event",
            "event": name,
            "t": time(),
            "step": step,
        }
        del record["client_version"]
        if message is not None:
            record["message"] = message[:MAX_MESSAGE_CHARS]
        self._sender.add_control(record)

    def _detect_cuda(self, final: bool) -> None:
        self._cuda_checked = final
        clock = _cuda.detect(self._reset_peak)
        if clock is not None:
            self._cuda_checked = True
            self._cuda = clock
            self._sender.clock = clock
            if self._gpu is None:
                self._sender.set_gpu(clock.gpu)
            if final:  # CUDA came into use after the hello: say hello again, with the device
                self._sender.add_control(self._sender.hello)

    def _step_failed(self, exc: BaseException | None, step: int | None) -> None:
        self._phases = {}
        self._marks = []
        self._pending_t0 = None
        if _cuda.is_out_of_memory(exc):
            self._event("oom", str(exc), self._seq if step is None else step)


def _valid_gpu(gpu: object) -> bool:
    if isinstance(gpu, str):
        return is_label(gpu, MAX_GPU_CHARS)
    return type(gpu) is int and 0 <= gpu < MAX_GPU_INDEX


def _close_live_monitors() -> None:
    # At exit, before weakref finalizers: close() also reports an OOM that ended an open step.
    for monitor in list(_live_monitors):
        monitor.close()


def _after_fork_in_child() -> None:
    # The parent's sender thread does not exist here and the parent's records are not ours.
    for monitor in list(_live_monitors):
        monitor._enabled = False
        monitor._buffer.clear()


atexit.register(_close_live_monitors)
os.register_at_fork(after_in_child=_after_fork_in_child)


class _Step:
    """One step's context manager; the hot path, so it does as little as possible."""

    __slots__ = ("_m", "_samples", "_tokens", "_flops", "_step", "_memory")

    def __init__(
        self,
        m: StepMonitor,
        samples: Any,
        tokens: Any,
        flops: Any,
        step: int | None,
        memory: Mapping[str, int] | None = None,
    ) -> None:
        self._m = m
        self._samples = samples
        self._tokens = tokens
        self._flops = flops
        self._step = step
        self._memory = memory

    def __enter__(self) -> _Step:
        m = self._m
        m._step_depth += 1
        if m._step_depth == 1:
            if not m._cuda_checked:
                m._detect_cuda(final=True)
            m._step_t0 = perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        m = self._m
        m._step_depth -= 1
        if m._step_depth:
            return
        t1 = perf_counter()
        if exc_type is not None:
            m._step_failed(exc, self._step)
            return
        t0 = m._pending_t0
        if t0 is None:
            t0 = m._step_t0
        else:
            m._pending_t0 = None
        phases = m._phases
        m._phases = {}
        marks = None
        mem: _cuda.MemoryTuple | Mapping[str, int] | None = None
        if m._cuda is not None:
            marks = m._marks
            m._marks = []
            mem = m._cuda.memory()
            if mem is not None:
                m._last_ooms = mem[4]
        if mem is None:
            mem = self._memory
        if m._enabled:
            m._buffer.append(
                (m._seq, self._step, t0, t1, phases, self._samples, self._tokens, self._flops, mem, marks)
            )
        m._seq += 1


class _Phase:
    """A named phase's context manager, one per name and monitor (reused)."""

    __slots__ = ("_m", "_name", "_host_clock")

    def __init__(self, m: StepMonitor, name: str, host_clock: bool) -> None:
        self._m = m
        self._name = name
        self._host_clock = host_clock

    def __enter__(self) -> _Phase:
        m = self._m
        if not m._phase_depth:
            if m._cuda is not None and not self._host_clock:
                m._phase_event = m._cuda.event()
            t = m._phase_t0 = perf_counter()
            if not m._step_depth and m._pending_t0 is None:
                m._pending_t0 = t
        m._phase_depth += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        m = self._m
        m._phase_depth -= 1
        if not m._phase_depth:
            phases = m._phases
            name = self._name
            phases[name] = phases.get(name, 0.0) + (perf_counter() - m._phase_t0)
            start = m._phase_event
            if start is not None:
                m._phase_event = None
                m._marks.append((name, start, m._cuda.event()))  # type: ignore[union-attr]
