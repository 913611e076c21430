"""Watchers that add measured fields to step records (collective communication, the memory
breakdown, the wait for a CPU): the monitor's one extension point, ``StepMonitor.extensions``.

A watcher attaches to a monitor with ``monitor.extensions.attach(Kind, factory)``: the
monitor's extension of class ``Kind``, made by ``factory()`` (default ``Kind()``) and registered
on the first call, returned as it is on every later one (one extension of each class per
monitor, so watching twice registers nothing twice). ``monitor.extensions.describe(framework,
zero_stage)`` names what drives the loop, for the agent. ``monitor.extensions.device_clock()`` is
the monitor's CUDA clock once CUDA is seen in use, else ``None``; it holds no reference to the
monitor, so an extension a process-wide hook keeps never keeps its monitor alive. Watchers use
these three and nothing else of the monitor; they are handed it as a ``seam.Watched`` and
import nothing of the monitor's module.

An extension is any object with ``step_begin() -> None`` and ``step_end(fields) -> None``, and
optionally ``quiet_until() -> float``: the ``perf_counter()`` reading before which its
``step_begin`` would do nothing and its ``step_end`` set nothing (the memory breakdown's next
sample). While every extension registered is quiet, the core calls none of them: a step costs
no Python call for them.
Both run on the training thread, at the start and the end of every outermost step from the
next one on (``step_end`` also after a step an exception left: its fields are discarded, but
the extension may have to undo what ``step_begin`` set up). ``step_end`` may set
``fields["comm"]`` / ``fields["memb"]`` / ``fields["cpu_wait"]`` in their wire shape
(docs/architecture.md §6), or a ``Deferred`` the sender resolves once the GPU has passed its
events; the sender checks them as the agent would and leaves out, and counts, what the agent
would refuse.

The hook's core holds a ``StepExtensions`` only while one extension is registered, so a monitor
without extensions makes no call into Python for them. An extension that raises never
reaches the training loop: the error is counted (``ClientStats.extension_errors``), and after
``MAX_CONSECUTIVE_FAILURES`` in a row that extension is switched off for good.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from gpumon.client.core.cuda_clock import CudaClock
    from gpumon.wire import ParallelLayout

E = TypeVar("E", bound="StepExtension")

MAX_CONSECUTIVE_FAILURES = 3
"""Failures in a row after which an extension is no longer called: a watcher broken by an
API it did not expect must not cost every step an exception."""


class Deferred(Protocol):
    """A measured field the GPU has still to reach (figures from CUDA events): the sender
    holds the step's record until ``ready()``, then sends ``value()`` (``None``: the field is
    left out), or gives up after its deadline and calls ``abandon()``. Both run on the
    sender's thread and never wait."""

    def ready(self) -> bool: ...

    def value(self) -> object | None: ...

    def abandon(self) -> None: ...


class StepExtension(Protocol):
    """What a watcher provides; see the module docstring."""

    def step_begin(self) -> None: ...

    def step_end(self, fields: dict[str, object]) -> None: ...


class StepExtensions:
    """The registered extensions, called in order; never lets an ``Exception`` out."""

    def __init__(self, on_empty: Callable[[], None] | None = None,
                 quiet: Callable[[float], None] | None = None) -> None:
        self._on_empty = on_empty  # called when the last extension was switched off
        self._quiet = quiet  # the core's set_quiet_until
        self._quiet_ones: list[Callable[[], float]] | None = None  # while every one has a quiet_until
        self._active: list[StepExtension] = []
        self._failures: dict[int, int] = {}  # id(extension) -> steps in a row it failed in
        self._failed_begin: set[int] = set()  # ids that failed this step's step_begin
        self.errors = 0

    def add(self, extension: StepExtension) -> None:
        """Register ``extension`` (again: nothing happens)."""
        if not any(e is extension for e in self._active):
            self._active.append(extension)
            self._changed()

    def __bool__(self) -> bool:
        return bool(self._active)

    def begin(self) -> None:
        """Tell every extension a step begins."""
        for extension in self._active:
            try:
                extension.step_begin()
            except Exception:
                self.errors += 1
                self._failed_begin.add(id(extension))

    def end(self, recorded: bool) -> dict[str, object] | None:
        """Collect the fields the extensions measured for the step that ended, or ``None``;
        a step that is not ``recorded`` (an exception left it) gets none."""
        fields: dict[str, object] | None = None
        failed_begin, failures = self._failed_begin, self._failures
        for extension in self._active:  # (a failure replaces the list; this one runs on)
            own: dict[str, object] = {}
            try:
                extension.step_end(own)
            except Exception:
                self.errors += 1
                self._step_failed(extension)  # what it set before failing is not trusted
                continue
            if failed_begin and id(extension) in failed_begin:
                self._step_failed(extension)
                continue
            if failures:
                failures.pop(id(extension), None)
            if own:
                if fields is None:
                    fields = own
                else:
                    fields.update(own)
        if failed_begin:
            failed_begin.clear()
        quiet_ones = self._quiet_ones
        if quiet_ones is not None and self._quiet is not None:
            self._quiet(min(quiet_until() for quiet_until in quiet_ones))
        return fields if recorded else None

    def wake(self) -> None:
        """Call the extensions at the next step whatever they said (``quiet_until``)."""
        if self._quiet is not None:
            self._quiet(-math.inf)

    def _changed(self) -> None:
        """The extensions changed: quiet only while each one can say until when."""
        quiet_ones = [getattr(e, "quiet_until", None) for e in self._active]
        self._quiet_ones = None if None in quiet_ones or not quiet_ones else quiet_ones  # type: ignore[assignment]
        if self._quiet is not None:
            self._quiet(-math.inf)  # call them at the next step; end() says for how long not

    def _step_failed(self, extension: StepExtension) -> None:
        key = id(extension)
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        if failures >= MAX_CONSECUTIVE_FAILURES:
            self._active = [e for e in self._active if e is not extension]
            del self._failures[key]
            self._changed()
            if not self._active and self._on_empty is not None:
                self._on_empty()


class DeviceClock:
    """Call it for the monitor's CUDA clock, or ``None`` while CUDA is not seen in use."""

    __slots__ = ("clock",)

    def __init__(self) -> None:
        self.clock: CudaClock | None = None

    def __call__(self) -> CudaClock | None:
        return self.clock


class Extensions:
    """``StepMonitor.extensions``: where watchers attach to a monitor (see the module docstring).

    ``activate`` is the core's ``set_extensions``: it gets the calls to make around each step,
    or ``None`` once nothing is left to call.
    """

    def __init__(self, activate: Callable[[StepExtensions | None], None],
                 describe: Callable[[str, int | None], None] | None = None,
                 data_wait: Callable[[float, float], None] | None = None,
                 quiet: Callable[[float], None] | None = None,
                 place: Callable[[ParallelLayout], None] | None = None) -> None:
        self._activate = activate
        self._describe = describe
        self._place = place
        self._data_wait = data_wait
        self._attached: dict[type, StepExtension] = {}
        self._calls = StepExtensions(on_empty=lambda: activate(None), quiet=quiet)
        self._closed = False
        self.device_clock = DeviceClock()
        """The monitor's CUDA clock, looked up at each call (``None`` without CUDA)."""

    def attach(self, kind: type[E], factory: Callable[[], E] | None = None) -> E:
        """The monitor's extension of class ``kind``: made by ``factory()`` (default
        ``kind()``) and called around every step from the next one on, the first time;
        the same object, and nothing else done, every later time. On a closed monitor it is
        made but never called."""
        existing = self._attached.get(kind)
        if isinstance(existing, kind):
            return existing
        extension = kind() if factory is None else factory()
        self._attached[kind] = extension
        if not self._closed:
            self._calls.add(extension)
            self._activate(self._calls)
        return extension

    def describe(self, framework: str, zero_stage: int | None = None) -> None:
        """Tell the agent what drives the loop (``deepspeed``) and its ZeRO stage: sent with
        the monitor's hello, and exported per rank. A name that is not a label is ignored."""
        if self._describe is not None and not self._closed:
            self._describe(framework, zero_stage)

    def place(self, layout: ParallelLayout) -> None:
        """Tell the agent where the rank sits in its job's parallelism (a watcher found it):
        sent with the monitor's hello; what the monitor was told by its caller wins."""
        if self._place is not None and not self._closed:
            self._place(layout)

    def data_wait(self, t0: float, t1: float) -> None:
        """Count ``t1 - t0`` (``perf_counter``) as waiting for input before the next step, for
        watchers and integrations whose framework fetches the batches itself."""
        if self._data_wait is not None and not self._closed:
            self._data_wait(t0, t1)

    def wake(self) -> None:
        """Call the extensions at the next step: a quiet one has work now (any thread)."""
        self._calls.wake()

    def get(self, kind: type[E]) -> E | None:
        """The monitor's extension of class ``kind``, or ``None`` if none is attached."""
        existing = self._attached.get(kind)
        return existing if isinstance(existing, kind) else None

    @property
    def errors(self) -> int:
        """Exceptions raised by the extensions so far (none reached the training loop)."""
        return self._calls.errors

    def close(self) -> None:
        """Attach nothing to the core any more (the monitor closed)."""
        self._closed = True
