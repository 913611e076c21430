"""Where the hook's time goes on a CUDA training step: each CUDA call it makes, timed alone
(and again beside a thread running Python, to show which calls give up the GIL), torch's
events against the same events recorded through the CUDA runtime from C, then alternated
blocks of steps with the hook as it was before the CUDA-path fixes (torch events on every
step), with runtime events on every step, as it is now (runtime events on one step per
100 ms, host clocks between), and on host clocks only; optionally a profile.

    PYTHONPATH=. python3 benchmarks/gpu_hook_profile.py [--pairs 20] [--transformer-pairs 8]

Needs a GPU: on one, ``gpu_node_check.py``'s overhead section found the hook costing far more
per step than its CPU cost here, and this is what found why.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_checks.workload import Workload  # noqa: E402

from gpumon.client import StepMonitor  # noqa: E402
from gpumon.client.monitor import IMPLEMENTATION  # noqa: E402


def native() -> Any:
    """The hook's CUDA runtime events (None: the C core or the runtime's symbols are missing)."""
    from gpumon.client.core.cuda_clock import native_runtime

    return native_runtime(0, getattr(torch._C, "_cuda_getCurrentRawStream", None))


def native_record(runtime: Any) -> Callable[[], Any]:
    """Record one runtime event and give it straight back (as the sender does once read)."""
    def call() -> None:
        event = runtime.record()
        if event is not None:
            runtime.release(event)
    return call


def per_call(n: int = 2000) -> dict[str, float]:
    """Microseconds per call of each CUDA query the hook makes, on an idle GPU."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    torch.cuda.synchronize()
    runtime = native()
    calls: dict[str, Callable[[], Any]] = {
        "memory_stats_as_nested_dict": lambda: torch.cuda.memory_stats_as_nested_dict(0),
        "reset_peak_memory_stats": lambda: torch.cuda.reset_peak_memory_stats(0),
        "_C._cuda_memoryStats": lambda: torch._C._cuda_memoryStats(0),
        "memory_allocated": lambda: torch.cuda.memory_allocated(0),
        "max_memory_allocated": lambda: torch.cuda.max_memory_allocated(0),
        "Event(enable_timing=True)": lambda: torch.cuda.Event(enable_timing=True),
        "event.record()": event.record,
        "event.query()": event.query,
        "time.perf_counter()": time.perf_counter,
    }
    if runtime is not None:
        calls["CudaRuntime.record() (GIL held)"] = native_record(runtime)
    out = {}
    for name, call in calls.items():
        call()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        out[name] = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return out


def drain(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)

    def run() -> None:
        while True:
            try:
                sock.recv(1 << 17)
            except OSError:
                return

    threading.Thread(target=run, daemon=True).start()
    return sock


def gil_release(n: int = 300) -> dict[str, float]:
    """µs per call of each event method while another thread spins in Python: a call that
    releases the GIL waits for it back (up to the 5 ms switch interval) and shows it here."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    torch.cuda.synchronize()
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    out = {}
    calls: dict[str, Callable[[], Any]] = {
        "event.query()": end.query,
        "start.elapsed_time(end)": lambda: start.elapsed_time(end),
        "event.record()": end.record,
        "memory_stats_as_nested_dict": lambda: torch.cuda.memory_stats_as_nested_dict(0),
        "time.perf_counter()": time.perf_counter}
    runtime = native()
    if runtime is not None:
        calls["CudaRuntime.record() (GIL held)"] = native_record(runtime)
    for name, call in calls.items():
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        out[name] = (time.perf_counter() - t0) / n * 1e6
    stop.set()
    spinner.join()
    torch.cuda.synchronize()
    return out


def variants(work: Workload, path: str, pairs: int, block: int) -> dict[str, dict[str, float]]:
    """Throughput ratio to bare blocks, and extra µs per step, of the hook as it was before
    the CUDA-path fixes, as it is now, and with host clocks only (no CUDA calls at all)."""
    names = ["before", "runtime_every_step", "after", "host_clock_only"]
    monitors = {name: StepMonitor(f"profile-{name}", socket_path=path) for name in names}
    for mon in monitors.values():
        work.train(3, mon)
        work.sync()
        mon.flush()
    for name, mon in monitors.items():
        clock = mon._cuda
        assert clock is not None
        print(f"  {work.kind:12s} {name:18s} runtime events: {clock.runtime is not None}")
        if name == "before":  # torch events on every step, six a step, memory every step
            clock.__dict__.pop("event", None)  # the torch path
            clock.runtime = None
            clock.device_interval_s = 0.0
            clock.share_gap_s = 0.0
            clock._current_stream = None
            clock.memory_interval_s = 0.0
        elif name == "runtime_every_step":  # the runtime's events, but on every step
            clock.device_interval_s = 0.0
        elif name == "host_clock_only":
            mon._core.set_cuda(None)  # no events, no allocator statistics: the host-side hook alone
    for name in ("before", "runtime_every_step", "after"):  # events per step, counted on 50 steps
        clock = monitors[name]._cuda
        recorded = [0]
        own = clock.__dict__.get("event")
        original = clock.event

        def counting(original: Any = original, recorded: list[int] = recorded) -> Any:
            recorded[0] += 1
            return original()

        clock.event = counting
        work.train(50, monitors[name])
        work.sync()
        if own is None:
            del clock.event  # the class's method again
        else:
            clock.event = own
        print(f"  {work.kind:12s} {name:18s} events recorded per step: {recorded[0] / 50:.2f}")
    results: dict[str, dict[str, float]] = {}
    for name, mon in monitors.items():
        ratios, extra = [], []
        for k in range(pairs):
            times = {}
            for kind in (("bare", name) if k % 2 == 0 else (name, "bare")):
                work.sync()
                t0 = time.perf_counter()
                work.train(block, None if kind == "bare" else mon)
                work.sync()
                if kind != "bare":
                    mon.flush()
                times[kind] = (time.perf_counter() - t0) / block
            ratios.append(times["bare"] / times[name])
            extra.append((times[name] - times["bare"]) * 1e6)
        results[name] = {"median_ratio": round(statistics.median(ratios), 4),
                         "median_extra_us_per_step": round(statistics.median(extra), 1)}
        print(f"  {work.kind:12s} {name:18s} {results[name]}", flush=True)
    for mon in monitors.values():
        mon.close()
    return results


def profile(work: Workload, path: str, steps: int) -> str:
    mon = StepMonitor("profile-cprofile", socket_path=path)
    work.train(5, mon)
    profiler = cProfile.Profile()
    profiler.enable()
    work.train(steps, mon)
    work.sync()
    profiler.disable()
    mon.close()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20, help="pairs of blocks, MLP")
    parser.add_argument("--transformer-pairs", type=int, default=8)
    parser.add_argument("--block-steps", type=int, default=50)
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--profile", action="store_true", help="also cProfile 300 hooked MLP steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_hook_profile: needs CUDA")
    print(f"hook core: {IMPLEMENTATION}; torch {torch.__version__}; {torch.cuda.get_device_name(0)}")
    torch.cuda.init()
    print("µs per call, idle GPU:")
    for name, us in per_call().items():
        print(f"  {name:30s} {us:8.2f}")
    print("µs per call while another thread runs Python (GIL released and waited for?):")
    for name, us in gil_release().items():
        print(f"  {name:30s} {us:8.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "sink.sock")
        sink = drain(path)
        for kind in args.models.split(","):
            work = Workload(torch, kind, "cuda")
            work.train(10)
            pairs = args.transformer_pairs if kind == "transformer" else args.pairs
            variants(work, path, pairs, args.block_steps)
            if kind == "mlp" and args.profile:
                print(profile(work, path, 300))
        sink.close()


if __name__ == "__main__":
    main()
