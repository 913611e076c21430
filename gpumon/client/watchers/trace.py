"""Profiler traces on demand, a rank's part inside its steps: ``Tracer``, a step extension.

The agent asks a rank for its next K steps under ``torch.profiler`` through the rank's trace
channel (``gpumon.client.trace_control``, docs/architecture.md §5.2). A request attaches
``Tracer`` (``StepMonitor.extensions``), which is quiet whenever no trace is asked for: the core
then makes no call into it. Asked, it arms one step (a ``TraceClock`` takes the place of the
core's CUDA clock, so every phase boundary is stamped), profiles the next K whole steps
(``torch.profiler``, started in one step's ``step_begin``, stopped in the Kth's ``step_end``),
with each step a ``record_function`` range, and hands the result to the channel's writer
thread. Anything the profiler raises ends the trace with an error answer, never the job.
"""

from __future__ import annotations

import sys
import time
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

from gpumon.client.watchers.trace_clock import TraceClock
from gpumon.client.watchers.trace_file import TracedStep

if TYPE_CHECKING:
    from gpumon.client.core.cuda_clock import CudaClock
    from gpumon.client.watchers.trace_tap import RecordTap


class TraceRequest:
    """A request the channel accepted: the steps to trace, the directory to write the file into
    and the address to answer."""

    def __init__(self, ident: str, steps: int, directory: str, reply_to: bytes | str) -> None:
        self.ident, self.steps, self.directory, self.reply_to = ident, steps, directory, reply_to
        self.accepted_at = time.monotonic()


class TraceChannel(Protocol):
    """What a ``Tracer`` asks of the channel that hands it requests (``TraceControl``): the
    core's step count, the clock and the sender's transport swapped while tracing, the writer
    and the answers."""

    def core_steps(self) -> int: ...

    def core_step_origin(self) -> float | None: ...

    def cuda_clock(self) -> CudaClock | None: ...

    def install_clock(self, clock: TraceClock) -> None: ...

    def restore_clock(self) -> None: ...

    def start_tap(self) -> RecordTap: ...

    def stop_tap(self, tap: RecordTap) -> None: ...

    def exporting(self) -> bool: ...

    def written(self, request: TraceRequest, prof: Any, steps: list[TracedStep],
                clock: TraceClock, tap: RecordTap) -> None: ...

    def reply(self, request: TraceRequest, state: str, **fields: Any) -> None: ...


class Tracer:
    """The step extension that profiles K whole steps once asked (see the module docstring).
    ``quiet_until()`` is +inf while idle, so the core calls it no more than any quiet watcher."""

    def __init__(self, control: TraceChannel) -> None:
        self._control = control
        self.request: TraceRequest | None = None  # set by the sender thread, taken here
        self._active: TraceRequest | None = None
        self._prof: Any = None
        self._clock: TraceClock | None = None
        self._left = 0
        self._steps: list[TracedStep] = []  # (seq, perf begin, perf end)
        self._range: Any = None
        self._begun = False
        self._tap: RecordTap | None = None
        self._restore = False  # give the core its clock back at the next step's begin

    def quiet_until(self) -> float:
        busy = self.request is not None or self._active is not None or self._restore
        return -float("inf") if busy else float("inf")

    def step_begin(self) -> None:
        enter = perf_counter()
        self._begun = True
        if self._restore:  # after the last traced step's end was stamped (its marks kept)
            self._restore = False
            self._control.restore_clock()
        active = self._active
        if active is None:
            request, self.request = self.request, None
            if request is None:
                return
            self._active = request
            self._arm()
            return
        clock = self._clock
        if self._prof is None:
            if clock is None or not clock.device_next:
                return  # the step beginning is not stamped yet (CUDA: not GPU-timed)
            if self._control.exporting():
                # The profiler is one per process: a session started while the last one's
                # results are still being exported can crash the process. Wait a step.
                return
            if not self._start():
                return
        try:
            seq = self._control.core_steps()
            origin = self._control.core_step_origin()
            t = perf_counter()
            self._range = _enter_range(f"gpumon.step {seq}")
            self._steps.append(TracedStep(seq, enter, (t + perf_counter()) / 2, t,
                                          origin=origin))
        except Exception as exc:
            self._fail("profiler_error", exc)

    def end(self) -> None:
        """The process is ending (its monitor closes): stop a profile under way and answer it.
        A profiler left running when the interpreter exits crashes the process (SIGSEGV)."""
        if self._active is not None:
            self._fail("ended", message="the process ended before its traced steps did")

    def step_end(self, fields: dict[str, object]) -> None:
        if not self._begun or self._prof is None or not self._steps:
            return
        self._begun = False
        try:
            _exit_range(self._range)
            self._range = None
            self._steps[-1] = self._steps[-1]._replace(end=perf_counter())
            self._left -= 1
            if self._left <= 0:
                self._finish()
            else:
                self._steps[-1] = self._steps[-1]._replace(left=perf_counter())
        except Exception as exc:
            self._fail("profiler_error", exc)

    # -- the training thread's part of a trace --------------------------------------------

    def _arm(self) -> None:
        if "torch" not in sys.modules:
            self._end_request("error", reason="no_torch",
                              message="the process has not imported torch: nothing to profile")
            return
        self._clock = TraceClock(self._control.cuda_clock())
        self._clock.collect = []
        self._control.install_clock(self._clock)
        self._tap = self._control.start_tap()
        self._left = self._active.steps if self._active is not None else 0
        self._steps = []

    def _start(self) -> bool:
        try:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self._clock is not None and self._clock.inner is not None:
                activities.append(ProfilerActivity.CUDA)
            prof = profile(activities=activities, record_shapes=True)
            prof.start()
            _exit_range(_enter_range("gpumon.trace"))  # the first range costs a setup
        except Exception as exc:
            self._fail("profiler_error", exc)
            return False
        self._prof = prof
        return True

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        request, self._active = self._active, None
        clock = self._clock
        self._restore = True
        prof.stop()
        self._steps[-1] = self._steps[-1]._replace(left=perf_counter())
        assert request is not None and clock is not None and self._tap is not None
        self._control.written(request, prof, self._steps, clock, self._tap)

    def _fail(self, reason: str, exc: BaseException | None = None, message: str = "") -> None:
        prof, self._prof = self._prof, None
        if self._range is not None:
            try:
                _exit_range(self._range)
            except Exception:
                pass
            self._range = None
        if prof is not None:
            try:
                prof.stop()
            except Exception:
                pass
        self._control.restore_clock()
        if self._tap is not None:
            self._control.stop_tap(self._tap)
        if exc is not None:
            message = f"{type(exc).__name__}: {exc}"
        self._end_request("error", reason=reason, message=message[:300])

    def _end_request(self, state: str, **fields: Any) -> None:
        request, self._active = self._active, None
        if request is not None:
            self._control.reply(request, state, **fields)


def _enter_range(name: str) -> Any:
    from torch.profiler import record_function

    handle = record_function(name)
    handle.__enter__()
    return handle


def _exit_range(handle: Any) -> None:
    if handle is not None:
        handle.__exit__(None, None, None)
