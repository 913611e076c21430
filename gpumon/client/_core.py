"""The training thread's half of ``StepMonitor``: step and phase timing, in pure Python.

``gpumon.client._hook`` is the same class in C, built when a compiler is at hand at install
time, and used in its place: on a CPU-sized step the interpreter's work at the eight or so
points a hooked loop passes through each step is most of what the hook costs (see
``benchmarks/RESULTS.md``). This module is the reference the C code follows line by line and
the fallback where it was not built; ``tests/client/test_core.py`` runs both.

A subclass provides three methods the hot path calls rarely: ``_detect_cuda(final)`` (at
the first step), ``_step_failed(exc, step)`` (an exception left a step) and
``_new_phase(name)`` (a phase name seen for the first time: validate it, make its ``Phase``
and store it in ``_phase_cache``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from time import perf_counter
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from gpumon.client._cuda import CudaClock, Mark, MemoryTuple
    from gpumon.client._extensions import StepExtensions
    from gpumon.client._sender import StepTuple

T = TypeVar("T")

SHARE_GAP_S = 10e-6
"""A CUDA-timed phase entered this soon after the previous one ended, in the same step, starts
at that phase's end event instead of recording its own: recording an event costs 6-11 µs of
the training thread (measured on an H200), and no kernel launch fits in the gap."""


class HookCore:
    """State the training thread owns, and the three calls a training loop makes."""

    def __init__(self, buffer: deque[StepTuple]) -> None:
        self._enabled = True
        self._seq = 0  # completed steps, recorded or not
        self._step_depth = 0
        self._step_t0 = 0.0
        self._pending_t0: float | None = None  # start of timed work before the next step
        self._phases: dict[str, float] = {}
        self._phase_depth = 0
        self._phase_t0 = 0.0
        self._phase_event: Any = None
        self._phase_end_t = 0.0  # when the last CUDA-timed phase's end event was recorded
        self._share_gap_s = SHARE_GAP_S
        self._marks: list[Mark] = []
        self._phase_cache: dict[str, Phase] = {}
        self._cuda: CudaClock | None = None
        self._cuda_checked = False
        self._last_ooms: int | None = None
        self._buffer = buffer
        self._extensions: StepExtensions | None = None  # None unless one is registered

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
        return Step(self, samples, tokens, flops, step, memory)

    def phase(self, name: str) -> Phase:
        """Context manager timing part of a step: ``data``, ``forward``, ``backward``,
        ``comm``, ``optimizer``, or any other label (the agent counts those as ``other``).

        With CUDA in use, phases other than ``data`` are timed by CUDA events, read later
        without synchronising. Nested phases: only the outermost is timed. A phase outside a
        step belongs to the next step. Raises ``ValueError`` for a name that is not 1-64 of
        ``[A-Za-z0-9_.:/-]``.
        """
        ctx = self._phase_cache.get(name)
        if ctx is None:
            ctx = self._new_phase(name)
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

    def _data_wait(self, t0: float, t1: float) -> None:
        """Count ``t1 - t0`` (perf_counter) as waiting for input before the next step."""
        if not self._step_depth and self._pending_t0 is None:
            self._pending_t0 = t0
        self._phases["data"] = self._phases.get("data", 0.0) + (t1 - t0)

    def _set_extensions(self, extensions: StepExtensions | None) -> None:
        """Call ``extensions`` at every step's start and end from now on (``None``: stop)."""
        self._extensions = extensions

    # Provided by the subclass.
    def _detect_cuda(self, final: bool) -> None:
        raise NotImplementedError

    def _step_failed(self, exc: BaseException | None, step: int | None) -> None:
        raise NotImplementedError

    def _new_phase(self, name: str) -> Phase:
        raise NotImplementedError


class Step:
    """One step's context manager; the hot path, so it does as little as possible."""

    __slots__ = ("_m", "_samples", "_tokens", "_flops", "_step", "_memory")

    def __init__(
        self,
        m: HookCore,
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

    def __enter__(self) -> Step:
        m = self._m
        m._step_depth += 1
        if m._step_depth == 1:
            if not m._cuda_checked:
                m._detect_cuda(True)
            if m._extensions is not None:
                m._extensions.begin()
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
        extensions = m._extensions
        fields = None if extensions is None else extensions.end(exc_type is None)
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
        mem: MemoryTuple | Mapping[str, int] | None = None
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
                (m._seq, self._step, t0, t1, phases, self._samples, self._tokens, self._flops, mem, marks,
                 fields)
            )
        m._seq += 1


class Phase:
    """A named phase's context manager, one per name and monitor (reused)."""

    __slots__ = ("_m", "_name", "_host_clock")

    def __init__(self, m: HookCore, name: str, host_clock: bool) -> None:
        self._m = m
        self._name = name
        self._host_clock = host_clock

    def __enter__(self) -> Phase:
        m = self._m
        if not m._phase_depth:
            if m._cuda is not None and not self._host_clock:
                marks = m._marks
                if marks and perf_counter() - m._phase_end_t < m._share_gap_s:
                    m._phase_event = marks[-1][2]
                else:
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
                m._phase_end_t = perf_counter()
