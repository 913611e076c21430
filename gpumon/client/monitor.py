"""``StepMonitor``: times training steps and their phases and reports them to the gpumon agent.

The training thread only reads clocks and appends one tuple per step to a bounded buffer
(``HookCore``: in C where it was built, else ``_core``'s pure Python); a daemon thread
(``_sender``) encodes and sends them. Nothing here ever blocks the training loop or raises
from the transport.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections import deque
from dataclasses import dataclass, field
from time import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import gpumon
from gpumon.client import _core, _cuda
from gpumon.client._extensions import StepExtension, StepExtensions
from gpumon.client._sender import Sender, StepTuple
from gpumon.client.identity import resolve_identity, resolve_socket_path
from gpumon.client.transport import Transport, UnixDatagramTransport
from gpumon.wire import (
    MAX_GPU_CHARS,
    MAX_GPU_INDEX,
    MAX_LABEL_CHARS,
    MAX_MESSAGE_CHARS,
    EventRecord,
    HelloRecord,
    is_label,
)

if TYPE_CHECKING or os.environ.get("GPUMON_PURE_PYTHON"):
    from gpumon.client._core import HookCore, Phase, Step
else:
    try:
        from gpumon.client._hook import HookCore, Phase, Step
    except ImportError:  # not built here: no compiler at install time, or not Linux
        from gpumon.client._core import HookCore, Phase, Step

IMPLEMENTATION = "c" if HookCore is not _core.HookCore else "python"
"""Which ``HookCore`` runs the hot path: ``"c"``, or ``"python"`` (``GPUMON_PURE_PYTHON=1``
forces it)."""

__all__ = ["IMPLEMENTATION", "ClientStats", "Phase", "Step", "StepMonitor"]

BUFFER_STEPS = 4096
"""Steps held for the sender; when it falls behind, the oldest are dropped and counted."""

HOST_CLOCK_PHASES = frozenset({"data"})
"""Phases timed on the host even with CUDA: waiting for input is not GPU work."""

M = TypeVar("M")

_live_monitors: weakref.WeakSet[StepMonitor] = weakref.WeakSet()


@dataclass(frozen=True, slots=True)
class ClientStats:
    """What a monitor did so far: steps timed, records sent, records lost by reason, fields
    left out as invalid, and errors raised inside watchers (``watch()``), which never reach
    the training loop."""

    steps: int
    records_sent: int
    datagrams_sent: int
    dropped: dict[str, int] = field(default_factory=dict)
    invalid_fields: int = 0
    extension_errors: int = 0


class StepMonitor(HookCore):
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
        buffer: deque[StepTuple] = deque(maxlen=BUFFER_STEPS)
        super().__init__(buffer)  # the hot-path state, touched only by the training thread

        hello = HelloRecord(self.run, self.rank, self.world, self.local_rank, os.getpid(),
                            client_version=gpumon.__version__)
        self._sender = Sender(transport, hello, buffer)
        if gpu is not None:
            self._sender.set_gpu(gpu)
        self._detect_cuda(final=False)
        self._sender.add_control(self._sender.hello)
        self._step_extensions: StepExtensions | None = None
        self._finalizer = weakref.finalize(self, self._sender.close)
        _live_monitors.add(self)

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
            extension_errors=0 if self._step_extensions is None else self._step_extensions.errors,
        )

    @property
    def gpu(self) -> str | int | None:
        """The device reported: the one given, else the CUDA device (UUID, else index) once
        CUDA is seen in use."""
        if self._gpu is not None:
            return self._gpu
        return None if self._cuda is None else self._cuda.gpu

    def watch(self, model: M, optimizer: Any = None) -> M:
        """Measure what the loop cannot see of ``model`` in every later step; returns ``model``.

        A ``DistributedDataParallel`` or FSDP module: its collective communication (exposed
        and overlapped seconds, bytes and count per kind of collective), with no ``comm``
        phase to time by hand. Call it before the first backward and, with DDP, before
        registering a comm hook of your own (the hook is kept and measured either way).
        Idempotent; a plain module is left as it is; never raises into the training loop.
        """
        from gpumon.client.watch import watch

        return watch(self, model, optimizer)

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
            mem = self._cuda.read_memory()
            if mem is not None and self._last_ooms is not None and mem[4] > self._last_ooms:
                self._event("oom", "an out-of-memory error ended the last step", self._seq)
        self._enabled = False
        self._set_extensions(None)
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

    # --- used by the integrations and watchers --------------------------------------------

    def _add_extension(self, extension: StepExtension) -> None:
        """Call ``extension.step_begin()`` and ``.step_end(fields)`` around every step from
        the next one on; the fields it sets go into that step's record (see ``_extensions``)."""
        if not self._enabled:
            return
        if self._step_extensions is None:
            ref = weakref.ref(self)  # no cycle: the monitor's finalizer runs when it goes

            def all_disabled() -> None:  # nothing left to call: back to no calls at all
                monitor = ref()
                if monitor is not None:
                    monitor._set_extensions(None)

            self._step_extensions = StepExtensions(on_empty=all_disabled)
        self._step_extensions.add(extension)
        self._set_extensions(self._step_extensions)

    def _event(self, name: str, message: str | None, step: int) -> None:
        """Queue an event record (e.g. ``oom``) for the next flush."""
        if not self._enabled:
            return
        hello = self._sender.hello
        if message is not None:
            message = message[:MAX_MESSAGE_CHARS]
        record = EventRecord(hello.run, hello.rank, name, time(), step, hello.pid, hello.gpu, message)
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

    def _new_phase(self, name: str) -> Phase:
        if not isinstance(name, str) or not is_label(name, MAX_LABEL_CHARS):
            raise ValueError(f"phase name {name!r}: use 1-64 of letters, digits, _ . : / -")
        ctx = self._phase_cache[name] = Phase(self, name, name in HOST_CLOCK_PHASES)
        return ctx

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
