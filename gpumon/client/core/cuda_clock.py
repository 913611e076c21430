"""CUDA-event phase timing and allocator statistics, when the training code uses CUDA.

Nothing here imports torch: it only uses the module the training code already imported.
Events are recorded through the CUDA runtime torch has loaded, from C with the GIL held
(``_hook.cuda_runtime``), where the C core is built and the runtime's symbols are found;
else through ``torch.cuda.Event``, whose ``record()`` releases the GIL (next to a busy Python
thread, the training thread can wait milliseconds to get it back: benchmarks/RESULTS.md §7).
"""

from __future__ import annotations

import importlib
import os
import sys
from time import perf_counter
from typing import Any

from gpumon.wire.records import MEM_WIRE_NAMES

MemoryTuple = tuple[int, int, int, int, int]
"""The allocator statistics in the wire's order, ``MEM_WIRE_NAMES``: allocated, reserved, peak
(since the previous reading: the previous step, or for steps shorter than ``MEMORY_INTERVAL_S``
the several since), alloc retries, OOMs. The encoder writes it as it stands."""

MEMORY_OOMS = MEM_WIRE_NAMES.index("ooms")
"""Where a ``MemoryTuple`` holds the allocator's OOM count (``hook/hook.h`` holds the same index;
``tests/client/test_core.py`` holds both cores to it)."""

Mark = tuple[str, Any, Any]
"""A phase name with its start and end CUDA events (a phase that began as the one before it
ended starts at that one's end event: the same object)."""

SHARE_GAP_S = 10e-6
"""A CUDA-timed phase entered this soon after the previous one ended, in the same step, starts
at that phase's end event instead of recording its own: recording an event costs the training
thread more than the gap (benchmarks/RESULTS.md §7), and no kernel launch fits in it."""

DEVICE_INTERVAL_S = 0.1
"""Phases are timed with CUDA events on one step per this interval (decided as a step ends,
for the next one: the step after the first to end past the interval), with host clocks on
the others. Recording events through torch costs the training thread enough to matter on a
short step if every step paid it, and nothing noticeable once per interval
(benchmarks/RESULTS.md §7). A time interval rather than one step in N keeps
that cost per second the same for short and long steps, and still puts about ten GPU-timed
steps in each second the agent judges; a step longer than the interval is timed every time."""

MEMORY_INTERVAL_S = 0.05
"""Allocator statistics are read at most this often, on GPU-timed steps only (so in fact at
most once per ``DEVICE_INTERVAL_S``): reading them is costly next to a short step
(benchmarks/RESULTS.md §7). The peak read covers every step since the previous reading, so none is
missed."""


class CudaClock:
    """Records CUDA events around phases and reads allocator statistics of one device.

    Events are recorded on the current stream and read later, from the sender thread, once
    ``query()`` says the GPU has passed them: the training loop never synchronises.
    """

    def __init__(
        self,
        cuda: Any,
        device: int,
        reset_peak: bool,
        memory_interval_s: float = MEMORY_INTERVAL_S,
        current_stream: Any = None,
        device_interval_s: float = DEVICE_INTERVAL_S,
        runtime: Any = None,
    ) -> None:
        """``runtime``: a ``_hook.CudaRuntime`` to record events with instead of torch's
        (``native_runtime``); ``current_stream`` then is not used."""
        self._cuda = cuda
        self._event_type = cuda.Event
        self.device = device
        self.gpu = _gpu_id(cuda, device)
        self._reset_peak = reset_peak
        self._pool: list[Any] = []
        self.memory_interval_s = memory_interval_s
        self.device_interval_s = device_interval_s  # 0: every step is timed on the GPU
        self.share_gap_s = SHARE_GAP_S  # 0 turns the sharing of boundary events off
        self._next_memory_read = 0.0
        # torch's Event.record() builds a Stream object for the current stream on every call
        # (Python work on the training thread: benchmarks/RESULTS.md §7).
        # ``current_stream(device)`` (torch._C._cuda_getCurrentStream) returns the raw stream
        # id in one C call, so the object is kept and rebuilt only when the current stream
        # changes. Without it, or if it fails, record() finds the stream.
        self._current_stream = current_stream
        self._stream_key: Any = None
        self._stream: Any = None
        self.runtime = runtime
        if runtime is not None:
            # Both cores call ``clock.event()``: this makes it one C call, the GIL held.
            self.event = runtime.record  # type: ignore[method-assign]

    def event(self) -> Any:
        """A timing event recorded now on the current stream (reused from a pool)."""
        try:
            event = self._pool.pop()
        except IndexError:
            event = self._event_type(enable_timing=True)
        if self._current_stream is None:
            event.record()
            return event
        try:
            key = self._current_stream(self.device)
            if key != self._stream_key:
                self._stream = self._cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
                self._stream_key = key
        except Exception:
            self._current_stream = None
            event.record()
            return event
        event.record(self._stream)
        return event

    def memory(self) -> MemoryTuple | None:
        """The allocator statistics, when ``memory_interval_s`` has passed since the last
        reading, else ``None``; resets the peak so the next reading has its own."""
        now = perf_counter()
        if now < self._next_memory_read:
            return None
        self._next_memory_read = now + self.memory_interval_s
        return self.read_memory()

    def read_memory(self) -> MemoryTuple | None:
        """The allocator statistics now; resets the peak so the next reading has its own."""
        try:
            stats = self._cuda.memory_stats_as_nested_dict(self.device)
            if self._reset_peak:
                self._cuda.reset_peak_memory_stats(self.device)
            allocated = stats["allocated_bytes"]["all"]
            return (
                allocated["current"],
                stats["reserved_bytes"]["all"]["current"],
                allocated["peak"],
                stats["num_alloc_retries"],
                stats["num_ooms"],
            )
        except Exception:  # a statistics hiccup must never reach the training loop
            return None

    def passed(self, event: Any) -> bool:
        """Whether the GPU has reached ``event`` (never waits)."""
        return bool(event.query() if self.runtime is None else self.runtime.query(event))

    def elapsed_s(self, start: Any, end: Any) -> float:
        """GPU seconds from ``start`` to ``end``, both passed (negative if ``end`` came first)."""
        if self.runtime is None:
            return float(start.elapsed_time(end)) / 1000.0
        return float(self.runtime.elapsed_ms(start, end)) / 1000.0

    def release(self, event: Any) -> None:
        """Give a passed event back for reuse."""
        if self.runtime is None:
            self._pool.append(event)
        else:
            self.runtime.release(event)

    def resolve(self, marks: list[Mark]) -> dict[str, float] | None:
        """GPU seconds per phase once every event has completed, else ``None`` (not yet)."""
        phases: dict[str, float] = {}
        try:
            if not all(self.passed(end) for _, _, end in marks):
                return None
            for name, start, end in marks:
                phases[name] = phases.get(name, 0.0) + self.elapsed_s(start, end)
        except Exception:
            return {}
        previous_end = None
        for _, start, end in marks:
            if start is not previous_end:  # a shared boundary goes back to the pool once
                self.release(start)
            self.release(end)
            previous_end = end
        return phases


def detect(reset_peak: bool) -> CudaClock | None:
    """A clock for the current CUDA device if the process has initialised CUDA, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        if not (cuda.is_available() and cuda.is_initialized()):
            return None
        private = getattr(torch, "_C", None)
        device = cuda.current_device()
        current_stream = getattr(private, "_cuda_getCurrentStream", None)
        runtime = native_runtime(device, getattr(private, "_cuda_getCurrentRawStream", None))
        return CudaClock(cuda, device, reset_peak, current_stream=current_stream, runtime=runtime)
    except Exception:
        return None


def native_runtime(device: int, current_raw_stream: Any) -> Any:
    """A ``_hook.CudaRuntime`` for ``device``, or ``None``: without the C core (not built, or
    ``GPUMON_PURE_PYTHON``), or where no loaded library has the runtime's symbols (torch
    without CUDA, a runtime linked into torch without exported symbols). ``current_raw_stream``
    (``torch._C._cuda_getCurrentRawStream``) gives the stream to record on."""
    if os.environ.get("GPUMON_PURE_PYTHON"):
        return None
    try:
        return importlib.import_module("gpumon.client.core._hook").cuda_runtime(device, current_raw_stream)
    except Exception:
        return None


def is_out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` is torch's (CUDA) OutOfMemoryError."""
    torch = sys.modules.get("torch")
    if torch is None or exc is None:
        return False
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return oom is not None and isinstance(exc, oom)


def _gpu_id(cuda: Any, device: int) -> str | int:
    """The device's UUID in NVML's form (``GPU-…``) when torch knows it, else its index."""
    try:
        uuid = str(cuda.get_device_properties(device).uuid)
    except Exception:
        return device
    if not uuid:
        return device
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
