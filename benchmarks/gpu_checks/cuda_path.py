"""The CUDA path's costs on the training thread, for the device script's overhead section:
µs per event record (torch's, which gives up the GIL, against the CUDA runtime's from the C
core, which keeps it), and hook calls that hold the loop over 1 ms beside a thread running
Python (a pin-memory, logging or uploader thread in a real job)."""

from __future__ import annotations

import threading
import time
from typing import Any

from gpumon.testing import quantile

from .workload import Workload


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def cuda_call_costs(torch: Any, runtime: Any, n: int = 300) -> dict[str, dict[str, float]]:
    """µs per event record, torch's against the runtime's from C, on an idle GPU and beside a
    thread running Python (where a call that gives up the GIL waits to get it back)."""
    event = torch.cuda.Event(enable_timing=True)
    calls: dict[str, Any] = {"torch Event.record()": event.record}
    if runtime is not None:
        def native() -> None:
            handle = runtime.record()
            if handle is not None:
                runtime.release(handle)
        calls["CudaRuntime.record()"] = native
    stop = threading.Event()
    out: dict[str, dict[str, float]] = {}
    for beside in ("idle", "busy_python_thread"):
        spinner = None
        if beside != "idle":
            spinner = threading.Thread(target=_spin, args=(stop,), name="busy-python", daemon=True)
            spinner.start()
        try:
            for name, call in calls.items():
                call()
                t0 = time.perf_counter()
                for _ in range(n):
                    call()
                out.setdefault(name, {})[beside] = round((time.perf_counter() - t0) / n * 1e6, 2)
        finally:
            stop.set()
            if spinner is not None:
                spinner.join(timeout=5)
            stop.clear()
        torch.cuda.synchronize()
    return out


STALL_S = 0.001


class _TimedCalls:
    """The monitor's step and phase context managers, each entry and exit timed: the time the
    training thread spent inside the hook, per call (the loader is passed through: its wait
    is the data's, not the hook's)."""

    def __init__(self, mon: Any) -> None:
        self.mon = mon
        self.calls: list[float] = []

    def loader(self, iterable: Any) -> Any:
        return self.mon.loader(iterable)

    def step(self, **counts: Any) -> Any:
        return _Timed(self, self.mon.step(**counts))

    def phase(self, name: str) -> Any:
        return _Timed(self, self.mon.phase(name))


class _Timed:
    def __init__(self, owner: _TimedCalls, ctx: Any) -> None:
        self.owner, self.ctx = owner, ctx

    def __enter__(self) -> Any:
        t0 = time.perf_counter()
        self.ctx.__enter__()
        self.owner.calls.append(time.perf_counter() - t0)
        return self

    def __exit__(self, *exc: Any) -> None:
        t0 = time.perf_counter()
        self.ctx.__exit__(*exc)
        self.owner.calls.append(time.perf_counter() - t0)


def hook_stalls(work: Workload, mon: Any, steps: int) -> dict[str, Any]:
    """Hook calls that held the training thread over 1 ms while another thread ran Python
    (a pin-memory or logging thread in a real job): a call that gives up the GIL waits up to
    the 5 ms switch interval to get it back. The hook as configured, then torch's events on
    every step (how it was before), on the same model and monitor."""
    clock = mon._cuda
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), name="busy-python", daemon=True)
    spinner.start()
    out: dict[str, Any] = {}
    try:
        variants = [("as_configured", None)]
        if clock is not None:
            variants.append(("torch_events_every_step", clock))
        for name, changed in variants:
            work.sync()
            mon.flush()  # events of the previous variant read before its clock changes
            saved = None
            if changed is not None:
                saved = (changed.device_interval_s, changed.runtime, changed.__dict__.pop("event", None))
                changed.device_interval_s, changed.runtime = 0.0, None
            timed = _TimedCalls(mon)
            try:
                work.train(steps, timed)
                work.sync()
            finally:
                if changed is not None and saved is not None:
                    changed.device_interval_s, changed.runtime = saved[0], saved[1]
                    if saved[2] is not None:
                        changed.event = saved[2]
            calls = timed.calls
            out[name] = {"steps": steps, "hook_calls": len(calls),
                         "calls_over_1ms": sum(1 for c in calls if c > STALL_S),
                         "max_call_ms": round(max(calls) * 1e3, 3) if calls else None,
                         "p99_call_us": round(quantile(calls, 0.99) * 1e6, 1) if calls else None}
    finally:
        stop.set()
        spinner.join(timeout=5)
    mon.flush()
    return out
