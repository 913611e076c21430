"""Cost of the client hook per training step, against the same loop without it.

    python benchmarks/bench_hook.py [--blocks 2000] [--block-steps 200]

Blocks of empty steps are timed alternately bare and hooked (``mon.step()`` around three
``mon.phase()`` blocks, optionally under ``mon.loader()`` with counts), in one process, sending
to a real Unix datagram socket drained by a reader process (standing in for the agent).
Between blocks the hooked records are flushed synchronously and that flush is timed too:
it is the background sender's cost per record, paid off the training thread but sharing
its interpreter. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from gpumon.client import StepMonitor
from gpumon.protocol import decode_datagram


def reader(path: str, ready: Connection, done: Connection) -> None:
    """Drain the socket, counting records, until told to stop; report the count."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.05)
    ready.send(True)
    records = 0
    while not done.poll():
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            continue
        records += len(decode_datagram(data).records)
    sock.setblocking(False)
    while True:  # what is still queued
        try:
            records += len(decode_datagram(sock.recv(1 << 16)).records)
        except BlockingIOError:
            break
    done.send(records)


def bare(n: int) -> None:
    for _ in range(n):
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


def bare_loader(n: int) -> None:
    for _ in iter(range(n)):
        pass


def measure(
    name: str,
    base: Callable[[int], None],
    hook: Callable[[int], None],
    mon: StepMonitor,
    blocks: int,
    block_steps: int,
) -> dict[str, float]:
    """Median µs per step of ``base`` and ``hook`` blocks, alternated, and the flush cost."""
    base_us: list[float] = []
    hook_us: list[float] = []
    flush_us: list[float] = []
    mon.flush()
    for i in range(blocks):
        order = (base, hook) if i % 2 else (hook, base)
        for fn in order:
            t0 = time.perf_counter()
            fn(block_steps)
            elapsed = (time.perf_counter() - t0) / block_steps * 1e6
            (base_us if fn is base else hook_us).append(elapsed)
        t0 = time.perf_counter()
        mon.flush()
        flush_us.append((time.perf_counter() - t0) / block_steps * 1e6)
    bare_med = statistics.median(base_us)
    hook_med = statistics.median(hook_us)
    return {
        "case": name,
        "bare_us_per_step": bare_med,
        "hooked_us_per_step": hook_med,
        "hook_us_per_step": hook_med - bare_med,
        "sender_us_per_record": statistics.median(flush_us),
        "total_us_per_step": hook_med - bare_med + statistics.median(flush_us),
        "hooked_over_bare": hook_med / bare_med,
    }


def main() -> None:
    """Run the benchmark and print its table and JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2000)
    parser.add_argument("--block-steps", type=int, default=200)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="gpumon-bench") as tmp:
        path = os.path.join(tmp, "ingest.sock")
        ctx = multiprocessing.get_context("fork")
        ready_recv, ready_send = ctx.Pipe(duplex=False)
        done_parent, done_child = ctx.Pipe()
        proc = ctx.Process(target=reader, args=(path, ready_send, done_child), daemon=True)
        proc.start()
        ready_recv.recv()
        mon = StepMonitor(run="bench", socket_path=path)
        results = [
            measure("step + 3 phases", bare, hooked(mon), mon, args.blocks, args.block_steps),
            measure(
                "loader + step(counts) + 3 phases",
                bare_loader,
                hooked_loader(mon),
                mon,
                args.blocks,
                args.block_steps,
            ),
        ]
        mon.close()
        time.sleep(0.2)
        done_parent.send(True)
        received = done_parent.recv()
        proc.join()

    stats = mon.stats
    print(f"{'case':36} {'bare µs':>8} {'hooked µs':>10} {'hook µs':>8} {'sender µs':>10} {'total µs':>9}")
    for r in results:
        print(
            f"{r['case']:36} {r['bare_us_per_step']:8.3f} {r['hooked_us_per_step']:10.3f} "
            f"{r['hook_us_per_step']:8.3f} {r['sender_us_per_record']:10.3f} {r['total_us_per_step']:9.3f}"
        )
    print(
        f"steps {stats.steps}, records sent {stats.records_sent}, received {received}, "
        f"dropped {stats.dropped}, cpus {os.cpu_count()}"
    )
    print(
        json.dumps(
            {
                "benchmark": "hook",
                "results": results,
                "steps": stats.steps,
                "records_sent": stats.records_sent,
                "records_received": received,
                "dropped": stats.dropped,
            }
        )
    )


if __name__ == "__main__":
    main()
