"""How the hook's timing holds up when the agent does not keep up, and how soon a record arrives.

    python benchmarks/bench_client_latency.py [--steps 20000] [--arrivals 20]

Three measurements over a real Unix datagram socket, each against its baseline in the same run:

1. Step time (p50, p99, max) with an agent that never reads its socket (the queue fills, every
   send is refused as busy), against an agent that reads every datagram.
2. A loop of 1,000 steps with no agent at all (no socket file), against the same loop with one.
3. Seconds from a step's end to its record's arrival with no further step, flush or close
   (as when the next step hangs); the monitor promises about 0.3 s.

Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumon.client import StepMonitor  # noqa: E402


class Agent:
    """A bound datagram socket; with ``read``, a thread stamps each datagram's arrival."""

    def __init__(self, path: Path, read: bool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.arrivals: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if read else None
        if self._thread is not None:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            self.arrivals.append(time.perf_counter())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sock.close()


def step_times(mon: StepMonitor, steps: int) -> list[float]:
    """Each step's wall time, pausing every 500 steps so the sender fills the socket."""
    times = []
    for n in range(steps):
        started = time.perf_counter()
        with mon.step(), mon.phase("forward"):
            pass
        times.append(time.perf_counter() - started)
        if n % 500 == 499:
            time.sleep(0.02)
    return times


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stuck_against_reading(steps: int, tmp: Path) -> dict[str, dict[str, float]]:
    out = {}
    for name, read in (("reading agent", True), ("stuck agent", False)):
        path = tmp / f"{name.split()[0]}.sock"
        agent = Agent(path, read)
        mon = StepMonitor(run="bench-latency", socket_path=str(path))
        times = step_times(mon, steps)
        mon.close()
        agent.close()
        out[name] = {"p50_s": statistics.median(times), "p99_s": quantile(times, 0.99),
                     "max_s": max(times), "busy_drops": mon.stats.dropped.get("agent_busy", 0)}
    return out


def absent_against_present(tmp: Path) -> dict[str, float]:
    out = {}
    for name in ("present", "absent"):
        path = tmp / "present.sock" if name == "present" else tmp / "no" / "such.sock"
        agent = Agent(path, True) if name == "present" else None
        mon = StepMonitor(run="bench-latency", socket_path=str(path))
        started = time.perf_counter()
        for _ in range(1000):
            with mon.step(), mon.phase("forward"):
                pass
        out[f"{name}_1000_steps_s"] = time.perf_counter() - started
        mon.close()
        if agent is not None:
            agent.close()
    return out


def arrival_delays(count: int, tmp: Path) -> list[float]:
    path = tmp / "arrival.sock"
    agent = Agent(path, True)
    delays = []
    try:
        for _ in range(count):
            mon = StepMonitor(run="bench-latency", socket_path=str(path))
            mon.flush()  # the hello goes first, on its own
            time.sleep(0.3)
            seen = len(agent.arrivals)
            with mon.step():
                pass
            ended = time.perf_counter()
            while len(agent.arrivals) == seen and time.perf_counter() < ended + 10:
                time.sleep(0.001)
            if len(agent.arrivals) > seen:
                delays.append(agent.arrivals[seen] - ended)
            mon.close()
    finally:
        agent.close()
    return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--arrivals", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        stuck = stuck_against_reading(args.steps, tmp)
        absent = absent_against_present(tmp)
        delays = arrival_delays(args.arrivals, tmp)
    print(f"{'agent':<16}{'p50 µs':>10}{'p99 µs':>10}{'max ms':>10}{'busy drops':>12}")
    for name, s in stuck.items():
        print(f"{name:<16}{s['p50_s'] * 1e6:>10.2f}{s['p99_s'] * 1e6:>10.2f}{s['max_s'] * 1e3:>10.3f}"
              f"{s['busy_drops']:>12}")
    print(f"1,000 steps: {absent['present_1000_steps_s'] * 1e3:.2f} ms with an agent, "
          f"{absent['absent_1000_steps_s'] * 1e3:.2f} ms with none")
    if delays:
        print(f"arrival without further steps ({len(delays)} of {args.arrivals}): "
              f"p50 {statistics.median(delays):.3f} s, max {max(delays):.3f} s")
    print(json.dumps({"stuck": stuck, "absent": absent, "arrival_s": delays}))


if __name__ == "__main__":
    main()
