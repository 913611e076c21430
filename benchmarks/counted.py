"""Run one collector unchanged, counting its collection cycles in a memory-mapped file.

    python counted.py COUNT_FILE gpumon AGENT_ARGS...            # python -m gpumon.cli agent ...
    python counted.py COUNT_FILE nvitop-exporter EXPORTER_ARGS... # the nvitop-exporter command
    python counted.py COUNT_FILE gpustat --interval S             # gpustat.new_query() every S s
    python counted.py COUNT_FILE gpustat --serve PORT             # `gpustat --json` per GET
    python counted.py COUNT_FILE idle-loop --interval S           # wakes every S s, does nothing

Stdlib only, so it runs in either venv. The count (a little-endian int64 at offset 0, bumped
after every cycle) is what the benchmark reads to check cycles = window / interval; bumping
it costs well under a microsecond and no system call.
"""

from __future__ import annotations

import io
import mmap
import os
import runpy
import struct
import sys
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


class CycleCount:
    """An int64 counter in a shared file mapping."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, 8)
        self._map = mmap.mmap(fd, 8)
        os.close(fd)
        self.path = path
        self.value = 0

    def bump(self) -> None:
        self.value += 1
        struct.pack_into("<q", self._map, 0, self.value)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` counting one cycle per call."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                self.bump()

        return counted


def read_count(path: str) -> int:
    """The current count in ``path`` (0 before the first cycle)."""
    with open(path, "rb") as f:
        data = f.read(8)
    return struct.unpack("<q", data)[0] if len(data) == 8 else 0


def run_gpumon(count: CycleCount, args: list[str]) -> None:
    """The command line parses the flags, then execs (as ``gpumon agent`` does) this file
    again as ``gpumon-agent``, the agent's own entry point with its cycles counted."""
    import functools

    import gpumon.agent.run as command

    this = [sys.executable, os.path.abspath(__file__), count.path, "gpumon-agent"]
    exec_agent = functools.partial(command.exec_agent, entry=this)
    command.exec_agent = exec_agent  # type: ignore[assignment]
    sys.argv = ["gpumon", "agent", *args]
    runpy.run_module("gpumon.cli", run_name="__main__")


def run_gpumon_agent(count: CycleCount, args: list[str]) -> None:
    from gpumon.agent.collectors.nvml import GpuPoll
    from gpumon.agent.run import main

    GpuPoll.poll = count.wrap(GpuPoll.poll)  # type: ignore[method-assign]
    main(args)


def run_nvitop(count: CycleCount, args: list[str]) -> None:
    from nvitop_exporter.exporter import PrometheusExporter

    # update_host runs once per cycle, before the per-GPU updates.
    PrometheusExporter.update_host = count.wrap(PrometheusExporter.update_host)
    sys.argv = ["nvitop-exporter", *args]
    runpy.run_module("nvitop_exporter", run_name="__main__")


def every(interval_s: float, fn: Callable[[], object], count: CycleCount) -> None:
    """Call ``fn`` on fixed ticks, as nvitop-exporter and gpumon do (no catch-up burst)."""
    next_tick = time.monotonic()
    while True:
        fn()
        count.bump()
        next_tick += interval_s
        delay = next_tick - time.monotonic()
        if delay < 0:
            next_tick, delay = time.monotonic(), 0.0
        time.sleep(delay)


def run_idle(count: CycleCount, args: list[str]) -> None:
    every(float(args[1]), lambda: None, count)


def run_gpustat(count: CycleCount, args: list[str]) -> None:
    import gpustat

    if args[0] == "--interval":
        every(float(args[1]), gpustat.new_query, count)
    port = int(args[1])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            out = io.StringIO()
            gpustat.new_query().print_json(out)  # what `gpustat --json` prints
            count.bump()
            body = out.getvalue().encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main() -> None:
    path, which, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    count = CycleCount(path)
    runs = {"gpumon": run_gpumon, "gpumon-agent": run_gpumon_agent, "nvitop-exporter": run_nvitop,
            "gpustat": run_gpustat, "idle-loop": run_idle}
    runs[which](count, args)


if __name__ == "__main__":
    main()
