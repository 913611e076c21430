"""``StepMonitor``: times training steps and their phases and reports them to the gpumon agent.

The monitor holds a core (``HookCore``: in C where it was built, else ``step_core``'s pure
Python) that the training thread runs through: it only reads clocks and appends one tuple per
step to a bounded buffer. A daemon thread (``core/sender.py``) encodes and sends them. Nothing
here ever blocks the training loop or raises from the transport.

Watchers (``watch()``, the memory sampler, the simulator's ranks) add measured fields to each
step through ``monitor.extensions`` alone (``attach(Kind, factory)``, ``device_clock()``;
``gpumon.client.core.extensions``), never through the monitor's private attributes.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from time import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import gpumon
from gpumon.client.core import cuda_clock, step_core
from gpumon.client.core.extensions import Extensions
from gpumon.client.core.identity import resolve_identity, resolve_socket_path
from gpumon.client.core.sender import Sender
from gpumon.client.core.spans import SpanReporter, exiting_cleanly
from gpumon.client.core.stall import StallWatch, monotonic_and_unix
from gpumon.client.core.stats import ClientStats
from gpumon.client.core.step_tuple import StepTuple
from gpumon.client.core.transport import Transport, UnixDatagramTransport
from gpumon.client.side_channels import step_ring, trace_control, watch_checkpoints
from gpumon.client.watchers.layout import from_argument, merge
from gpumon.wire import (
    MAX_GPU_CHARS,
    MAX_GPU_INDEX,
    MAX_LABEL_CHARS,
    MAX_MESSAGE_CHARS,
    EventRecord,
    HelloRecord,
    ParallelLayout,
    is_label,
)

if TYPE_CHECKING:
    from gpumon.client.trace_control import TraceControl

if TYPE_CHECKING or os.environ.get("GPUMON_PURE_PYTHON"):
    from gpumon.client.core.step_core import HookCore, Phase, Step
else:
    try:
        from gpumon.client.core._hook import HookCore, Phase, Step
    except ImportError:  # not built here: no compiler at install time, or not Linux
        from gpumon.client.core.step_core import HookCore, Phase, Step

IMPLEMENTATION = "c" if HookCore is not step_core.HookCore else "python"
"""Which ``HookCore`` runs the hot path: ``"c"``, or ``"python"`` (``GPUMON_PURE_PYTHON=1``
forces it)."""

__all__ = ["IMPLEMENTATION", "ClientStats", "Phase", "Step", "StepMonitor"]

BUFFER_STEPS = 4096
"""Steps held for the sender; when it falls behind, the oldest are dropped and counted."""

HOST_CLOCK_PHASES = frozenset({"data"})
"""Phases timed on the host even with CUDA: waiting for input is not GPU work."""

T = TypeVar("T")
M = TypeVar("M")

_live_monitors: weakref.WeakSet[StepMonitor] = weakref.WeakSet()
_on_new_monitor: list[Callable[[StepMonitor], None]] = []
"""Called with every monitor made in this process, once it is set up (``gpumon run``'s hooks
learn so that the job watches itself, without a look at every step)."""


class StepMonitor:
    """Times each training step and its phases and reports them to the node's gpumon agent.

    Args:
        run: the run's name (1-128 of ``[A-Za-z0-9_.:/-]``); default ``$GPUMON_RUN``, else
            the job's (Slurm, Kubernetes, torchrun's ``--rdzv-id``), else the script's
            (``gpumon.client.core.run_name``).
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
        parallel: where this rank sits in the job's parallelism, as ``{dimension: index}``
            (``dp``, ``tp``, ``pp``, ``ep``, ``cp``, or a mesh dimension's own name); by
            default what ``watch()`` finds (a ``DeviceMesh``, a pipeline stage, DeepSpeed's
            or Megatron's parallel state), which this overrides dimension by dimension.

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
        parallel: Mapping[str, int] | None = None,
    ) -> None:
        ident = resolve_identity(run, rank, world, local_rank)
        self._parallel = from_argument(parallel) if parallel else None
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
        self._closed = False
        self._cuda: cuda_clock.CudaClock | None = None
        self._buffer: deque[StepTuple] = deque(maxlen=BUFFER_STEPS)
        # The hot-path state, touched only by the training thread.
        self._core = HookCore(self._buffer, self._first_step, self._step_failed, _phase_clock)
        ring = None if self.socket_path is None else step_ring(self._core.set_ring)
        self.extensions = Extensions(self._core.set_extensions, self._describe, self._core.data_wait,
                                     self._core.set_quiet_until, self._place)
        """Where watchers attach what they measure in each step:
        ``extensions.attach(Kind, factory)`` and ``extensions.device_clock()`` (see
        ``gpumon.client.core.extensions``)."""
        # The three calls of the loop go straight to the core: a Python method in between
        # would add a frame to each, a fair share of the C core's own cost
        # (benchmarks/RESULTS.md §4). The methods below carry the documentation and serve
        # calls through the class.
        self.step = self._core.step  # type: ignore[method-assign]
        self.phase = self._core.phase  # type: ignore[method-assign]
        self.loader = self._core.loader  # type: ignore[method-assign]

        hello = HelloRecord(self.run, self.rank, self.world, self.local_rank, os.getpid(),
                            client_version=gpumon.__version__, parallel=self._parallel)
        self._sender = Sender(transport, hello, self._buffer, ring=ring)
        # Watched from the sender's thread; it holds the core, never the monitor.
        self._stall = StallWatch(self._core, self.run, self.rank, hello.pid or os.getpid(),
                                 self._sender.send_state)
        stall = self._stall
        self._sender.on_wake = lambda: stall.tick(*monotonic_and_unix())
        self._trace = None if self.socket_path is None else self._trace_control()
        if self._trace is not None:
            poll = self._trace.poll

            def on_wake() -> None:
                stall.tick(*monotonic_and_unix())
                poll()
            self._sender.on_wake = on_wake
        if gpu is not None:
            self._sender.set_gpu(gpu)
        self._find_cuda(final=False)
        self._sender.add_control(self._sender.hello)
        core = self._core
        self._spans = SpanReporter(self._sender, lambda: core.steps)
        watch_checkpoints(self._spans)
        self._finalizer = weakref.finalize(self, self._sender.close)
        _live_monitors.add(self)
        for callback in _on_new_monitor:
            callback(self)

    def step(
        self,
        *,
        samples: int | None = None,
        tokens: int | None = None,
        flops: float | None = None,
        step: int | None = None,
        memory: Mapping[str, int] | None = None,
    ) -> Step:
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
        return self._core.step(samples=samples, tokens=tokens, flops=flops, step=step, memory=memory)

    def phase(self, name: str) -> Phase:
        """Context manager timing part of a step: ``data``, ``forward``, ``backward``,
        ``comm``, ``optimizer``, or any other label (the agent counts those as ``other``).

        With CUDA in use, phases other than ``data`` are timed by CUDA events, read later
        without synchronising. Nested phases: only the outermost is timed. A phase outside a
        step belongs to the next step. Raises ``ValueError`` for a name that is not 1-64 of
        ``[A-Za-z0-9_.:/-]``.
        """
        return self._core.phase(name)

    def loader(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield ``iterable``'s items, timing each wait as the ``data`` phase of the next step."""
        return self._core.loader(iterable)

    def checkpoint(self, *, load: bool = False) -> AbstractContextManager[None]:
        """Context manager around a checkpoint save of your own (``load=True``: a restore),
        outside any step: its time is the run's ``checkpoint`` badput, and once it completes
        without an exception the steps done before it count as goodput (docs/goodput.md). The
        saves of ``torch.save``, ``torch.distributed.checkpoint``, safetensors, Hugging Face,
        accelerate, DeepSpeed and Lightning are recognised without it."""
        return self._spans.timed("load" if load else "save", "mark")

    def evaluation(self) -> AbstractContextManager[None]:
        """Context manager around an evaluation pass outside any step: its time is the run's
        ``evaluation`` badput (Hugging Face's and Lightning's are recognised without it)."""
        return self._spans.timed("eval", "mark")

    @property
    def stats(self) -> ClientStats:
        """A snapshot of the counters."""
        sender = self._sender
        return ClientStats(
            steps=self._core.steps,
            records_sent=sender.records_sent,
            datagrams_sent=sender.datagrams_sent,
            dropped=dict(sender.dropped),
            invalid_fields=sender.invalid_fields,
            gpu_fields_missed=sender.deferred_missed,
            extension_errors=self.extensions.errors,
            state_reports=sender.state_sent,
            backlog_records=sender.backlog.records,
            backlog_bytes=sender.backlog.bytes,
            late_records=sender.backlog.late_sent,
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
        from gpumon.client.watchers.watch import watch

        return watch(self, model, optimizer)

    def expert_load(self, layer: int | str, tokens_per_expert: Any) -> None:
        """Count the tokens a MoE layer's router sent to each of its experts in this step:
        ``tokens_per_expert`` is a 1-D tensor (on any device: it is added there and copied
        without waiting, docs/moe.md) or a sequence of ints, one per expert of ``layer`` (an
        int or a name of 1-32 ``[A-Za-z0-9_.:/-]``). Call it once per layer and forward, for
        a router ``watch()`` does not recognise; several calls in one step add up. Each step
        then carries each layer's load over the last 50 steps: the busiest expert's tokens
        over the mean, the coefficient of variation, the experts that got none. Bad input is
        logged once per layer and dropped; it never raises into the training loop."""
        from gpumon.client.watchers.moe import count_expert_load

        count_expert_load(self, layer, tokens_per_expert)

    def flush(self) -> None:
        """Send buffered records now, from the calling thread, instead of at the next
        background flush (waits for a flush in progress: at most ~50 ms, when the agent is busy)."""
        if not self._closed:
            self._sender.flush()

    def close(self) -> None:
        """Send what is left and stop; later steps are not recorded. Idempotent. Unless an
        exception is ending the program, the process's part of the run is done: the agent
        keeps every step it did (docs/goodput.md)."""
        self._close(exiting_cleanly())

    def _close(self, finished: bool) -> None:
        if self._closed:
            return
        core = self._core
        if core.in_step and self._cuda is not None:
            # A step was left open (an integration without exception hooks): if the
            # allocator counted an OOM since the last step, that is what ended it.
            mem = self._cuda.read_memory()
            last_ooms = core.last_ooms
            if mem is not None and last_ooms is not None and mem[cuda_clock.MEMORY_OOMS] > last_ooms:
                self._event("oom", "an out-of-memory error ended the last step", core.steps)
                finished = False  # the run ended by its OOM, not by finishing
        if finished:
            self._spans.finished()
        self._spans.closed = True
        self._closed = True
        if self._trace is not None:
            self._trace.close(ending=True)
        self._stall.close(*monotonic_and_unix())
        self.extensions.close()
        core.stop()
        self._finalizer()

    def __enter__(self) -> StepMonitor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close(exc is None and exiting_cleanly())

    # --- used by the integrations and watchers --------------------------------------------

    def _event(self, name: str, message: str | None, step: int) -> None:
        """Queue an event record (e.g. ``oom``) for the next flush."""
        if self._closed:
            return
        hello = self._sender.hello
        if message is not None:
            message = message[:MAX_MESSAGE_CHARS]
        record = EventRecord(hello.run, hello.rank, name, time(), step, hello.pid, hello.gpu, message)
        self._sender.add_control(record)

    # --- called by the core ---------------------------------------------------------------

    def _first_step(self) -> None:
        """The first step begins: CUDA may have come into use since the monitor was made,
        and this is the thread whose stack says where a stalled rank is."""
        self._stall.training_thread = threading.get_ident()
        self._find_cuda(final=True)

    def _find_cuda(self, final: bool) -> None:
        clock = cuda_clock.detect(self._reset_peak)
        if clock is None:
            return
        self._cuda = clock
        self.extensions.device_clock.clock = clock
        self._core.set_cuda(clock)
        self._sender.clock = clock
        if self._gpu is None:
            self._sender.set_gpu(clock.gpu)
        if final:  # CUDA came into use after the hello: say hello again, with the device
            self._sender.add_control(self._sender.hello)

    def _describe(self, framework: str, zero_stage: int | None) -> None:
        """Say hello again, naming the framework (and its ZeRO stage) a watcher found."""
        if not is_label(framework, MAX_LABEL_CHARS) or (
                zero_stage is not None and not (type(zero_stage) is int and 0 <= zero_stage <= 3)):
            return
        hello = dataclasses.replace(self._sender.hello, framework=framework, zero_stage=zero_stage)
        self._sender.hello = hello
        self._sender.add_control(hello)

    def _place(self, found: ParallelLayout) -> None:
        """Say hello again with the layout a watcher found (what the caller gave wins)."""
        layout = merge([self._parallel, found])
        if layout is None or layout == self._sender.hello.parallel:
            return
        hello = dataclasses.replace(self._sender.hello, parallel=layout)
        self._sender.hello = hello
        self._sender.add_control(hello)

    def _trace_control(self) -> TraceControl | None:
        """The channel for profiler traces the agent asks for (``client/side_channels.py``)."""
        ref = weakref.ref(self)  # the sender's thread must never keep the monitor alive

        def monitor_clock() -> cuda_clock.CudaClock | None:
            live = ref()
            return None if live is None else live._cuda

        assert self.socket_path is not None
        return trace_control(self.socket_path, self.run, self.rank, self.world, self._core,
                             self._sender, self.extensions, monitor_clock)

    def _step_failed(self, exc: BaseException | None, step: int | None) -> None:
        if cuda_clock.is_out_of_memory(exc):
            self._event("oom", str(exc), self._core.steps if step is None else step)


def _phase_clock(name: Any) -> bool:
    """Whether a new phase name is timed on the host clock even with CUDA; ``ValueError`` if
    it is not a label."""
    if not isinstance(name, str) or not is_label(name, MAX_LABEL_CHARS):
        raise ValueError(f"phase name {name!r}: use 1-64 of letters, digits, _ . : / -")
    return name in HOST_CLOCK_PHASES


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
        monitor._closed = True
        if monitor._trace is not None:
            monitor._trace.close()
        monitor.extensions.close()
        monitor._core.stop()
        monitor._core.set_ring(None)  # the parent's ring, shared with this child: not ours
        monitor._buffer.clear()


atexit.register(_close_live_monitors)
os.register_at_fork(after_in_child=_after_fork_in_child)
