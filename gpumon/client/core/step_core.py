"""The training thread's half of ``StepMonitor``: step and phase timing, in pure Python.

``gpumon.client.core._hook`` is the same class in C, built when a compiler is at hand at install
time, and used in its place: on a CPU-sized step the interpreter's work at the eight or so
points a hooked loop passes through each step is most of what the hook costs (see
``benchmarks/RESULTS.md``). This module is the reference the C code follows line by line and
the fallback where it was not built; ``tests/client/test_core.py`` drives both through the
same script and compares every record.

The monitor holds a core; the core's surface is what a training loop calls (``step``, ``phase``,
``loader``, and ``data_wait`` for frameworks that report their own waits), what the monitor
configures (``set_cuda``, ``set_extensions``, ``stop``) and five readings (``steps``,
``in_step``, ``last_ooms``, ``open_phase`` for the stall watch, and ``step_origin`` for a
trace). The monitor hears back through three callables given at construction: ``first_step()``
(the first step begins and no CUDA clock is set yet: look for one), ``step_failed(exc, step)``
(an exception left a step, which is not recorded) and ``phase_clock(name)`` (a phase name seen
for the first time: raise ``ValueError`` if it is not valid, else say whether it is timed on the
host clock even with CUDA).

Neither core reuses ``Step`` objects: each ``step()`` call returns a new one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from time import perf_counter
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from gpumon.client.core.cuda_clock import MEMORY_OOMS

if TYPE_CHECKING:
    from gpumon.client.core.cuda_clock import CudaClock, Mark, MemoryTuple
    from gpumon.client.core.extensions import StepExtensions
    from gpumon.client.core.ring import StepRing
    from gpumon.client.core.step_tuple import StepTuple

T = TypeVar("T")


class HookCore:
    """State the training thread owns, and the calls a training loop makes."""

    def __init__(
        self,
        buffer: deque[StepTuple],
        first_step: Callable[[], object],
        step_failed: Callable[[BaseException | None, int | None], object],
        phase_clock: Callable[[str], bool],
    ) -> None:
        self._buffer = buffer
        self._first_step = first_step
        self._step_failed = step_failed
        self._phase_clock = phase_clock
        self._enabled = True
        self._started = False  # the first step has begun
        self._seq = 0  # completed steps, recorded or not
        self._step_depth = 0
        self._step_t0 = 0.0
        self._pending_t0: float | None = None  # start of timed work before the next step
        self._phases: dict[str, float] = {}
        self._phase_depth = 0
        self._phase_t0 = 0.0
        self._phase_event: Any = None
        self._phase_end_t = 0.0  # when the last CUDA-timed phase's end event was recorded
        self._device = True  # this step's phases get CUDA events (one step per device interval)
        self._next_device_t = 0.0  # the step after the first to end past this is timed on the GPU
        self._marks: list[Mark] = []
        self._phase_cache: dict[str, Phase] = {}
        self._cuda: CudaClock | None = None
        self._last_ooms: int | None = None
        self._extensions: StepExtensions | None = None  # None unless one is registered
        self._open_phase: str | None = None  # the open outermost phase
        self._loading = False  # the loader waits for the next item
        self._quiet_until = -math.inf  # until then (perf_counter) no extension needs a call
        self._extensions_called = False  # the open step's extensions were told it began
        self._ring: StepRing | None = None  # where each completed step is also written

    def step(
        self,
        *,
        samples: int | None = None,
        tokens: int | None = None,
        flops: float | None = None,
        step: int | None = None,
        memory: Mapping[str, int] | None = None,
    ) -> Step:
        """A context manager around one training step (see ``StepMonitor.step``)."""
        return Step(self, samples, tokens, flops, step, memory)

    def phase(self, name: str) -> Phase:
        """A context manager timing part of a step (see ``StepMonitor.phase``)."""
        ctx = self._phase_cache.get(name)
        if ctx is None:
            host_clock = self._phase_clock(name)
            ctx = self._phase_cache[name] = Phase(self, name, host_clock)
        return ctx

    def loader(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield ``iterable``'s items, timing each wait as the ``data`` phase of the next step."""
        t0 = perf_counter()
        iterator = iter(iterable)
        while True:
            self._loading = True
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self._loading = False
            self.data_wait(t0, perf_counter())
            yield item
            t0 = perf_counter()

    def data_wait(self, t0: float, t1: float) -> None:
        """Count ``t1 - t0`` (perf_counter) as waiting for input before the next step."""
        if not self._step_depth and self._pending_t0 is None:
            self._pending_t0 = t0
        self._phases["data"] = self._phases.get("data", 0.0) + (t1 - t0)

    def set_cuda(self, clock: CudaClock | None) -> None:
        """Time phases with ``clock``'s CUDA events and read its allocator statistics from now
        on, on one step per ``clock.device_interval_s``: the host clock times the others, so
        the events' cost is paid a few times a second, not every step (``None``: host clock
        only)."""
        self._cuda = clock

    def set_extensions(self, extensions: StepExtensions | None) -> None:
        """Call ``extensions`` at every step's start and end from now on (``None``: stop)."""
        self._extensions = extensions

    def set_quiet_until(self, t: float) -> None:
        """Until ``perf_counter()`` reads ``t``, a step begins and ends without calling the
        extensions: each one said it has nothing to do before then (``StepExtensions``)."""
        self._quiet_until = t

    def set_ring(self, ring: StepRing | None) -> None:
        """Write each completed step into ``ring`` too, as it ends (``None``: stop): what
        the sender has not sent yet survives the process (``client/core/ring.py``)."""
        self._ring = ring

    def stop(self) -> None:
        """Record no more steps and call no more extensions (the monitor closed, or this is
        a forked child whose parent owns the steps)."""
        self._enabled = False
        self._extensions = None

    @property
    def steps(self) -> int:
        """Steps completed so far, recorded or not."""
        return self._seq

    @property
    def step_origin(self) -> float | None:
        """The open step's record starts at this ``perf_counter`` reading (its begin, or the
        timed work before it); None outside a step."""
        if not self._step_depth:
            return None
        return self._pending_t0 if self._pending_t0 is not None else self._step_t0

    @property
    def in_step(self) -> bool:
        """Whether a step is open."""
        return self._step_depth > 0

    @property
    def open_phase(self) -> str | None:
        """The open outermost phase, ``"data"`` while the loader waits for an item, else None
        (read by the stall watch from another thread)."""
        if self._open_phase is not None:
            return self._open_phase
        return "data" if self._loading else None

    @property
    def last_ooms(self) -> int | None:
        """The allocator's OOM count at the last reading, if CUDA statistics were read."""
        return self._last_ooms


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

    def set_counts(self, samples: Any, tokens: Any, flops: Any) -> None:
        """Set the step's counts, when they are known only after it started."""
        self._samples, self._tokens, self._flops = samples, tokens, flops

    def __enter__(self) -> Step:
        m = self._m
        m._step_depth += 1
        if m._step_depth == 1:
            try:
                if not m._started:
                    m._started = True
                    if m._cuda is None:
                        m._first_step()
                # Stamped before the extensions start and after they end, so what they
                # measure (communication inside the step, say) lies within its duration.
                t0 = m._step_t0 = perf_counter()
                extensions = m._extensions
                m._extensions_called = extensions is not None and not t0 < m._quiet_until
                if extensions is not None and m._extensions_called:
                    extensions.begin()
            except BaseException:
                m._step_depth -= 1  # the block is not entered
                raise
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
        extensions = m._extensions if m._extensions_called else None
        fields = None if extensions is None else extensions.end(exc_type is None)
        t1 = perf_counter()
        if exc_type is not None:
            m._phases = {}
            m._marks = []
            m._pending_t0 = None
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
        cuda = m._cuda
        if cuda is not None:
            marks = m._marks
            m._marks = []
            if m._device:
                m._next_device_t = t1 + cuda.device_interval_s
                mem = cuda.memory()
                if mem is not None:
                    m._last_ooms = mem[MEMORY_OOMS]
            m._device = t1 >= m._next_device_t
        if mem is None:
            mem = self._memory
        if m._enabled:  # a StepTuple: the fields of step_tuple.StepFields, in its order
            m._buffer.append(
                (m._seq, self._step, t0, t1, phases, self._samples, self._tokens, self._flops, mem, marks,
                 fields)
            )
            ring = m._ring
            if ring is not None:
                ring.write(m._seq, self._step, t0, t1, self._samples, self._tokens, self._flops)
        m._seq += 1


class Phase:
    """A named phase's context manager, one per name and core (reused)."""

    __slots__ = ("_m", "_name", "_host_clock")

    def __init__(self, m: HookCore, name: str, host_clock: bool) -> None:
        self._m = m
        self._name = name
        self._host_clock = host_clock

    def __enter__(self) -> Phase:
        m = self._m
        if not m._phase_depth:
            cuda = m._cuda
            if cuda is not None and m._device and not self._host_clock:
                marks = m._marks
                if marks and perf_counter() - m._phase_end_t < cuda.share_gap_s:
                    m._phase_event = marks[-1][2]
                else:
                    m._phase_event = cuda.event()
            # A clock whose events are host-clock readings (a trace's) gives the phase's start.
            stamp = m._phase_event
            t = m._phase_t0 = float(stamp) if isinstance(stamp, float) else perf_counter()
            if not m._step_depth and m._pending_t0 is None:
                m._pending_t0 = t
            m._open_phase = self._name
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
            m._open_phase = None
            phases = m._phases
            name = self._name
            start = m._phase_event
            if start is None:
                phases[name] = phases.get(name, 0.0) + (perf_counter() - m._phase_t0)
            else:
                m._phase_event = None
                end = m._cuda.event()  # type: ignore[union-attr]
                t1 = float(end) if isinstance(end, float) else perf_counter()
                phases[name] = phases.get(name, 0.0) + (t1 - m._phase_t0)
                m._marks.append((name, start, end))
                m._phase_end_t = perf_counter()
