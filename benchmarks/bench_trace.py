"""What a trace channel costs a hooked CPU loop when no trace is asked for, and what the traced
steps cost when one is.

    python benchmarks/bench_trace.py [--blocks 41] [--block-steps 100] [--trace-steps 5] [--traces 3]

One process, one intra-op thread, an MLP step of about a millisecond hooked by hand (data,
forward, backward, optimizer), its records sent to a real Unix socket drained by a reader
process. Two monitors run the same loop in alternating blocks (the order within each pair
alternating too): one with its trace channel (the default), one made with ``GPUMON_TRACE=0``.
Their throughput ratio is measured before any trace and again after traces were taken (the
tracer then stays attached to the monitor, quiet). Then ``--traces`` traces of
``--trace-steps`` steps are asked of the channel's monitor, as the agent asks: the traced steps'
median time against the median of the untraced steps around them, the step that starts the
profiler and the one that stops it, and how long the writer thread took (off the loop).
Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
from time import perf_counter
from typing import Any

import torch
from bench_hook import drained_socket
from common import print_table

from gpumon.client import StepMonitor
from gpumon.wire.traces import channel_address


class Job:
    """An MLP and its data, stepped through one monitor at a time."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                         torch.nn.Linear(512, 256))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(64, 256)

    def steps(self, monitor: StepMonitor, n: int, times: list[float] | None = None) -> float:
        """Run ``n`` steps; their seconds (each one's in ``times``)."""
        start = perf_counter()
        for _ in range(n):
            t0 = perf_counter()
            with monitor.step():
                with monitor.phase("data"):
                    x = self.x.clone()
                with monitor.phase("forward"):
                    loss = self.model(x).square().mean()
                with monitor.phase("backward"):
                    loss.backward()
                with monitor.phase("optimizer"):
                    self.optimizer.step()
                    self.optimizer.zero_grad()
            if times is not None:
                times.append(perf_counter() - t0)
        return perf_counter() - start


def ratios(job: Job, channel: StepMonitor, plain: StepMonitor, blocks: int, block_steps: int) -> list[float]:
    """Per pair of blocks: the channel monitor's throughput ÷ the plain one's."""
    out = []
    for i in range(blocks):
        if i % 2:
            with_s, without_s = job.steps(channel, block_steps), job.steps(plain, block_steps)
        else:
            without_s, with_s = job.steps(plain, block_steps), job.steps(channel, block_steps)
        out.append(without_s / with_s)
    return out


def trace_once(job: Job, monitor: StepMonitor, socket_path: str, directory: str, steps: int,
               desk: socket.socket) -> dict[str, Any]:
    """Ask ``monitor`` for a trace and step until it is written; the steps' times around it."""
    times: list[float] = []
    job.steps(monitor, 50, times)
    first_seq = monitor.stats.steps - len(times)
    message = {"op": "trace", "id": f"b{first_seq}", "steps": steps, "dir": directory}
    desk.sendto(json.dumps(message).encode(), channel_address(socket_path, monitor.run, monitor.rank))
    asked = perf_counter()
    answers: list[dict[str, Any]] = []
    while not answers or answers[-1]["state"] not in ("done", "error"):
        job.steps(monitor, 5, times)
        try:
            while True:
                answers.append(json.loads(desk.recv(4096)))
        except BlockingIOError:
            pass
        assert perf_counter() - asked < 60, answers
    job.steps(monitor, 50, times)
    done = answers[-1]
    assert done["state"] == "done", done
    seq = next(i for i in range(len(times)) if first_seq + i == done["first_step"])
    traced = times[seq:seq + steps]
    around = times[:seq - 1] + times[seq + steps + 1:]
    os.unlink(done["path"])
    return {"traced_ratio": statistics.median(traced) / statistics.median(around),
            "first_traced_ms": traced[0] * 1e3, "last_traced_ms": traced[-1] * 1e3,
            "arming_ms": times[seq - 1] * 1e3, "median_step_ms": statistics.median(around) * 1e3,
            "asked_to_written_s": perf_counter() - asked, "bytes": done["bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=41)
    parser.add_argument("--block-steps", type=int, default=100)
    parser.add_argument("--trace-steps", type=int, default=5)
    parser.add_argument("--traces", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    job = Job()
    with drained_socket() as (path, finish), tempfile.TemporaryDirectory(prefix="gpumon-traces") as out:
        channel = StepMonitor("bench-trace", socket_path=path, rank=0, world=1)
        os.environ["GPUMON_TRACE"] = "0"
        plain = StepMonitor("bench-plain", socket_path=path, rank=0, world=1)
        del os.environ["GPUMON_TRACE"]
        job.steps(channel, 200)
        job.steps(plain, 200)
        before = ratios(job, channel, plain, args.blocks, args.block_steps)
        desk = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        desk.bind(b"")
        desk.setblocking(False)
        traces = [trace_once(job, channel, path, out, args.trace_steps, desk) for _ in range(args.traces)]
        after = ratios(job, channel, plain, args.blocks, args.block_steps)
        channel.close()
        plain.close()
        desk.close()
        finish()

    def q(values: list[float]) -> str:
        quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
        return f"{statistics.median(values):.4f} [{quartiles[0]:.4f}, {quartiles[2]:.4f}]"

    print_table(["no trace asked: throughput with the channel ÷ without", "median [quartiles]"],
                [["before any trace", q(before)], ["after traces (tracer attached, quiet)", q(after)]])
    def median(key: str) -> float:
        return statistics.median(t[key] for t in traces)

    print_table(["traced steps", "median over traces"], [
        [f"median traced step ÷ median untraced ({args.trace_steps} steps)",
         f"{median('traced_ratio'):.2f}×"],
        ["untraced step", f"{median('median_step_ms'):.2f} ms"],
        ["the step before (armed)", f"{median('arming_ms'):.2f} ms"],
        ["first traced step (starts the profiler)", f"{median('first_traced_ms'):.2f} ms"],
        ["last traced step (stops it)", f"{median('last_traced_ms'):.2f} ms"],
        ["asked to written (writer thread, off the loop)", f"{median('asked_to_written_s'):.2f} s"],
        ["trace file", f"{median('bytes') / 1e3:.0f} kB"],
    ])
    print(json.dumps({"idle_ratio": statistics.median(before),
                      "idle_ratio_after_trace": statistics.median(after),
                      "traces": traces, "traced_ratio": median("traced_ratio"),
                      "torch": torch.__version__, "trace_steps": args.trace_steps}))


if __name__ == "__main__":
    main()
