"""Cost of the client hook per training step, against the same loop without it and against
TensorBoard logging the same figures.

    python benchmarks/bench_hook.py [--blocks 2000] [--block-steps 200] [--tensorboard]

Blocks of empty steps are timed in rotation, in one process: bare, and hooked (``mon.step()``
around three ``mon.phase()`` blocks, optionally under ``mon.loader()`` with counts), sending
to a real Unix datagram socket drained by a reader process (standing in for the agent). Each
hooked monitor writes its steps to a step ring as well; the same loop without the ring
(``GPUMON_RING=0``), on both cores, measures what the ring costs.
After each block the hooked records are flushed synchronously and that flush is timed too
(its CPU time: it may also sleep while the reader drains a full socket): it is the background
sender's cost per record, paid off the training thread but sharing its interpreter.

``--tensorboard`` adds what a user would write instead: the loop timed by hand
(perf_counter around the loader and each phase) and the same eight figures (step and phase
seconds, samples, tokens, FLOPs) logged with ``torch.utils.tensorboard.SummaryWriter
.add_scalar``; its ``flush()`` after each block is the writer thread's share. TensorBoard and
torch (CPU) come from the peers' venv (benchmarks/.peers-venv, made on first use), which this
script re-runs itself in. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import count
from multiprocessing.connection import Connection
from time import perf_counter
from typing import Any

from gpumon.client import StepMonitor
from gpumon.client.monitor import IMPLEMENTATION
from gpumon.collectors.ingest import RECEIVE_BUFFER_BYTES
from gpumon.wire import decode_datagram

Case = tuple[Callable[[int], None], Callable[[], None] | None]
"""A loop of n steps, and what flushes its background work (None: nothing to flush)."""


def reader(path: str, ready: Connection, done: Connection) -> None:
    """Drain the socket as the agent's ingest does, and count the records, until told to stop;
    report the count.

    One thread only receives (into a queue) and another decodes, with the agent's GIL switch
    interval and receive buffer: a reader that decoded between receives would leave the
    socket full while it worked, and bill its slowness to the sender's retries.
    """
    sys.setswitchinterval(0.001)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
    sock.bind(path)
    sock.settimeout(0.05)
    queue: deque[bytes] = deque()
    stop = threading.Event()

    def receive() -> None:
        while not stop.is_set():
            try:
                queue.append(sock.recv(1 << 16))
            except TimeoutError:
                continue

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    ready.send(True)
    records = 0
    while True:
        stopping = done.poll(0.01)
        while queue:
            records += len(decode_datagram(queue.popleft()).records)
        if stopping:
            break
    stop.set()
    receiver.join()
    sock.setblocking(False)
    while True:  # what is still queued
        try:
            records += len(decode_datagram(sock.recv(1 << 16)).records)
        except BlockingIOError:
            break
    done.send(records)


@contextmanager
def drained_socket() -> Iterator[tuple[str, Callable[[], int]]]:
    """A socket path drained by a reader process, and a function that stops it and returns
    the records it received."""
    with tempfile.TemporaryDirectory(prefix="gpumon-bench") as tmp:
        path = os.path.join(tmp, "ingest.sock")
        ctx = multiprocessing.get_context("fork")
        ready_recv, ready_send = ctx.Pipe(duplex=False)
        done_parent, done_child = ctx.Pipe()
        proc = ctx.Process(target=reader, args=(path, ready_send, done_child), daemon=True)
        proc.start()
        ready_recv.recv()

        def finish() -> int:
            done_parent.send(True)
            received = int(done_parent.recv())
            proc.join()
            return received

        yield path, finish


def bare(n: int) -> None:
    for _ in range(n):
        pass


def bare_loader(n: int) -> None:
    for _ in iter(range(n)):
        pass


def hooked(mon: StepMonitor) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            with mon.step():
                with mon.phase("forward"):
                    pass
                with mon.phase("backward"):
                    pass
                with mon.phase("optimizer"):
                    pass

    return run


def hooked_loader(mon: StepMonitor) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in mon.loader(range(n)):
            with mon.step(samples=32, tokens=65536, flops=1.2e15):
                with mon.phase("forward"):
                    pass
                with mon.phase("backward"):
                    pass
                with mon.phase("optimizer"):
                    pass

    return run


def tensorboard_loop(writer: Any) -> Callable[[int], None]:
    """The loop timed by hand, logging what the hook reports: eight scalars per step."""
    steps = count()
    add = writer.add_scalar

    def run(n: int) -> None:
        batches = iter(range(n))
        while True:
            t0 = perf_counter()
            if next(batches, None) is None:
                break
            t1 = perf_counter()  # forward
            t2 = perf_counter()  # backward
            t3 = perf_counter()  # optimizer
            t4 = perf_counter()
            step = next(steps)
            add("step/duration_seconds", t4 - t0, step)
            add("step/data_seconds", t1 - t0, step)
            add("step/forward_seconds", t2 - t1, step)
            add("step/backward_seconds", t3 - t2, step)
            add("step/optimizer_seconds", t4 - t3, step)
            add("step/samples", 32, step)
            add("step/tokens", 65536, step)
            add("step/flops", 1.2e15, step)

    return run


def measure(cases: dict[str, Case], blocks: int, block_steps: int) -> dict[str, dict[str, float]]:
    """Median µs per step of each case's blocks, run in rotation, and of its flush after each
    block (µs per step of that block)."""
    loop_us: dict[str, list[float]] = {name: [] for name in cases}
    flush_us: dict[str, list[float]] = {name: [] for name in cases}
    flush_cpu_us: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for _, flush in cases.values():
        if flush is not None:
            flush()
    for i in range(blocks):
        for name in names[i % len(names):] + names[:i % len(names)]:
            run, flush = cases[name]
            t0 = perf_counter()
            run(block_steps)
            loop_us[name].append((perf_counter() - t0) / block_steps * 1e6)
            if flush is not None:
                t0, c0 = perf_counter(), time.thread_time()
                flush()
                flush_us[name].append((perf_counter() - t0) / block_steps * 1e6)
                flush_cpu_us[name].append((time.thread_time() - c0) / block_steps * 1e6)
    return {name: {"loop_us_per_step": statistics.median(loop_us[name]),
                   "flush_us_per_step": statistics.median(flush_us[name]) if flush_us[name] else 0.0,
                   "flush_cpu_us_per_step":
                       statistics.median(flush_cpu_us[name]) if flush_cpu_us[name] else 0.0}
            for name in cases}


def compare(
    base: str, hook: str, results: dict[str, dict[str, float]], flush_on_thread: bool
) -> dict[str, float]:
    """One hooked case against its bare loop. ``flush_on_thread``: the case's flush does its
    work on the calling thread (gpumon's sender), so its cost is that thread's CPU time,
    not the time it may sleep while the reader catches up; otherwise (TensorBoard's
    ``flush()`` waits for its writer thread) the flush's wall time."""
    bare_us = results[base]["loop_us_per_step"]
    hook_us = results[hook]["loop_us_per_step"]
    wall_us = results[hook]["flush_us_per_step"]
    sender_us = results[hook]["flush_cpu_us_per_step"] if flush_on_thread else wall_us
    return {
        "bare_us_per_step": bare_us,
        "hooked_us_per_step": hook_us,
        "hook_us_per_step": hook_us - bare_us,
        "sender_us_per_record": sender_us,
        "sender_wall_us_per_record": wall_us,
        "total_us_per_step": hook_us - bare_us + sender_us,
        "hooked_over_bare": hook_us / bare_us,
    }


def _have_tensorboard() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def _ring_off() -> Iterator[None]:
    """Monitors made inside keep no step ring (the hook before the ring)."""
    before = os.environ.get("GPUMON_RING")
    os.environ["GPUMON_RING"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["GPUMON_RING"]
        else:
            os.environ["GPUMON_RING"] = before


def _memory_watched_monitor(path: str) -> StepMonitor | None:
    """A monitor with the memory-breakdown sampler registered (a small model and its AdamW,
    the default 5 s between samples), or None without torch: what ``watch(model, optimizer)``
    adds to every step, sampled or not."""
    try:
        import torch

        from gpumon.client.watchers.memory import watch_memory
    except ImportError:
        return None
    mon = StepMonitor(run="bench-memory", socket_path=path)
    model = torch.nn.Linear(64, 64)
    watch_memory(mon, model, torch.optim.AdamW(model.parameters()))
    mon._bench_model = model  # type: ignore[attr-defined]  # the sampler holds it weakly
    return mon


def _cpu_wait_watched_monitor(path: str) -> StepMonitor:
    """A monitor reading its training thread's wait for a CPU at every step's edges: what
    ``watch()`` adds to every step of a distributed model, besides its communication."""
    from gpumon.client.watchers.cpu_wait import CpuWaitClock

    mon = StepMonitor(run="bench-cpu-wait", socket_path=path)
    mon.extensions.attach(CpuWaitClock)
    return mon


def main() -> None:
    """Run the benchmark and print its table and JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2000)
    parser.add_argument("--block-steps", type=int, default=200)
    parser.add_argument("--tensorboard", action="store_true",
                        help="also TensorBoard's add_scalar (runs in the peers' venv)")
    args = parser.parse_args()
    if args.tensorboard and not _have_tensorboard():
        from common import ROOT, peers_python

        python = str(peers_python())
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        os.execve(python, [python, __file__, *sys.argv[1:]], env)

    with drained_socket() as (path, finish), tempfile.TemporaryDirectory() as logdir:
        mon = StepMonitor(run="bench", socket_path=path)
        cases: dict[str, Case] = {
            "bare": (bare, None), "hooked": (hooked(mon), mon.flush),
            "bare_loader": (bare_loader, None), "hooked_loader": (hooked_loader(mon), mon.flush),
        }
        with _ring_off():
            mon_noring = StepMonitor(run="bench-noring", socket_path=path)
        cases["hooked_loader_noring"] = (hooked_loader(mon_noring), mon_noring.flush)
        mon_py = mon_py_noring = None
        if IMPLEMENTATION == "c":  # the pure-Python core too, for the before/after
            from common import pure_python_step_monitor

            mon_py = pure_python_step_monitor()(run="bench-python", socket_path=path)
            cases["hooked_loader_python"] = (hooked_loader(mon_py), mon_py.flush)
            with _ring_off():
                mon_py_noring = pure_python_step_monitor()(run="bench-python-noring", socket_path=path)
            cases["hooked_loader_python_noring"] = (hooked_loader(mon_py_noring), mon_py_noring.flush)
        mon_memory = _memory_watched_monitor(path)
        if mon_memory is not None:
            cases["hooked_loader_memory"] = (hooked_loader(mon_memory), mon_memory.flush)
        mon_cpu_wait = _cpu_wait_watched_monitor(path)
        cases["hooked_loader_cpu_wait"] = (hooked_loader(mon_cpu_wait), mon_cpu_wait.flush)
        writer = None
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=logdir)
            cases["tensorboard"] = (tensorboard_loop(writer), writer.flush)
        raw = measure(cases, args.blocks, args.block_steps)
        mon.close()
        mon_noring.close()
        if mon_py is not None:
            mon_py.close()
        if mon_py_noring is not None:
            mon_py_noring.close()
        if mon_memory is not None:
            mon_memory.close()
        mon_cpu_wait.close()
        if writer is not None:
            writer.close()
        time.sleep(0.2)
        received = finish()

    results: list[dict[str, Any]] = [
        {"case": "step + 3 phases", **compare("bare", "hooked", raw, True)},
        {"case": "loader + step(counts) + 3 phases", **compare("bare_loader", "hooked_loader", raw, True)},
    ]
    if writer is not None:
        results.append({"case": "TensorBoard: timed by hand + 8 add_scalar",
                        **compare("bare_loader", "tensorboard", raw, False)})
    results.append({"case": "the same, without the step ring",
                    **compare("bare_loader", "hooked_loader_noring", raw, True)})
    if mon_py is not None:
        results.append({"case": "the same, pure-Python core (no C build)",
                        **compare("bare_loader", "hooked_loader_python", raw, True)})
        results.append({"case": "pure-Python core, without the step ring",
                        **compare("bare_loader", "hooked_loader_python_noring", raw, True)})
    if mon_memory is not None:
        results.append({"case": "the same, memory breakdown watched",
                        **compare("bare_loader", "hooked_loader_memory", raw, True)})
    results.append({"case": "the same, CPU wait watched",
                    **compare("bare_loader", "hooked_loader_cpu_wait", raw, True)})
    stats = mon.stats
    print(f"{'case':42} {'bare µs':>8} {'with µs':>9} {'cost µs':>8} {'bg µs':>7} {'(wall)':>7} "
          f"{'total µs':>9}")
    for r in results:
        print(
            f"{r['case']:42} {r['bare_us_per_step']:8.3f} {r['hooked_us_per_step']:9.3f} "
            f"{r['hook_us_per_step']:8.3f} {r['sender_us_per_record']:7.3f} "
            f"{r['sender_wall_us_per_record']:7.3f} {r['total_us_per_step']:9.3f}"
        )
    print("cost: on the training thread, over the bare loop; bg: the flush after each block, per "
          "step: gpumon's sender, CPU time (wall: with waits for a full socket); TensorBoard's "
          "writer, wall time (its work is on the writer's thread)")
    if writer is not None:
        ratio = results[1]["total_us_per_step"] / results[2]["total_us_per_step"]
        print(f"gpumon (loader + counts) / TensorBoard, total per step: {ratio:.3f}×")
    print(f"hook core: {IMPLEMENTATION}")
    sent = stats.records_sent + (mon_py.stats.records_sent if mon_py is not None else 0)
    dropped = {**stats.dropped, **(mon_py.stats.dropped if mon_py is not None else {})}
    print(f"steps {stats.steps}, records sent {sent}, received {received}, "
          f"dropped {dropped}, cpus {os.cpu_count()}")
    print(
        json.dumps(
            {
                "benchmark": "hook",
                "results": results,
                "hook_core": IMPLEMENTATION,
                "steps": stats.steps,
                "records_sent": sent,
                "records_received": received,
                "dropped": dropped,
            }
        )
    )


if __name__ == "__main__":
    main()
