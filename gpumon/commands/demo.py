"""`gpumon demo`: an agent, a simulated GPU node and a synthetic multi-rank training job in one
process, with the live view of `gpumon top`.

The job reports through the real client hook to the agent's real socket; the agent classifies
its steps from the simulated GPU counters exactly as on a real node. Everything runs as
threads of this process, so SIGINT/SIGTERM stop all of it and nothing is left behind.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from gpumon.agent.config import AgentConfig
from gpumon.agent.lifecycle import Agent, AgentError
from gpumon.commands.top import StopSignals, render, stop_on_signals
from gpumon.errors import GpumonError
from gpumon.export.server import ServeError
from gpumon.sim.gpus import SimulatedSource, gpu_model
from gpumon.sim.job import SimulatedJob, check_job, describe
from gpumon.sim.schedule import Schedule

RUN = "demo"
ADDRESS = "127.0.0.1"  # a demo on a laptop has no business listening on every interface


@dataclass(frozen=True)
class DemoOptions:
    """What `gpumon demo` runs."""

    schedule: Schedule
    gpus: int = 8
    ranks: int = 8
    port: int = 9403
    socket: str | None = None
    """The agent's ingest socket; default ``demo-<pid>.sock`` in ``$XDG_RUNTIME_DIR/gpumon``
    (or the temp directory)."""
    duration_s: float | None = None
    ui: bool = True
    interval_s: float = 1.0
    model: str = "h100-sxm"
    report: Callable[[Path], Path] | None = None
    """Makes the page of the demo's run from its recording (beside the socket) once it stops,
    and returns where it went; ``None``: no recording, no page."""

    def __post_init__(self) -> None:
        gpu_model(self.model)
        check_job(self.schedule, self.ranks, self.gpus)


def default_socket_path() -> Path:
    """Where the demo's socket goes when none is given: a directory this user can write."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.access(runtime, os.W_OK):
        base = Path(runtime) / "gpumon"
    else:
        base = Path(tempfile.gettempdir()) / f"gpumon-{os.getuid()}"
    return base / f"demo-{os.getpid()}.sock"


class DemoError(GpumonError, RuntimeError):
    """The demo cannot start; the message says why."""


def run_demo(options: DemoOptions, out: TextIO | None = None) -> int:
    """Run until SIGINT/SIGTERM or ``duration_s``; returns the exit status (0)."""
    model = gpu_model(options.model)
    socket_path = Path(options.socket) if options.socket else default_socket_path()
    try:
        socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise DemoError(f"cannot create {socket_path.parent}: {exc.strerror or exc}") from exc
    source = SimulatedSource(options.gpus, model)
    recording = socket_path.with_suffix(".jsonl")
    config = AgentConfig(address=ADDRESS, port=options.port, socket=str(socket_path),
                         simulate=options.gpus, interval=options.interval_s,
                         record=str(recording) if options.report else None)
    job = SimulatedJob(source, options.schedule, ranks=options.ranks,
                       socket_path=str(socket_path), run=RUN)
    console = Console(file=out) if out is not None else Console()
    live_view = options.ui and console.is_terminal
    logging.basicConfig(level=logging.WARNING if live_view else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = Agent(config, gpu_source=source)
    with stop_on_signals() as stop:
        try:
            agent.start()
        except (ServeError, AgentError) as exc:
            agent.stop()
            raise DemoError(str(exc)) from exc
        job.start()
        try:
            if live_view:
                _live(agent, job, options, console, stop)
            else:
                _log(agent, job, options, console, stop)
        finally:
            job.stop()
            agent.stop()
    console.print(f"gpumon demo: stopped; {_steps(agent.snapshot())} steps were reported"
                  f"{_report(options, recording)}",
                  highlight=False, soft_wrap=True, markup=False)
    return 0


def _report(options: DemoOptions, recording: Path) -> str:
    """Where the page of this run went (or why there is none), for the last line."""
    if options.report is None:
        return ""
    try:
        return f"; the run in pictures: {options.report(recording)} (recorded in {recording})"
    except Exception as exc:  # the demo ran; a page that cannot be made is said, not raised
        return f"; no report of the run ({exc}); its recording: {recording}"


def _deadline(options: DemoOptions) -> float:
    return time.monotonic() + options.duration_s if options.duration_s else float("inf")


def _urls(agent: Agent) -> str:
    base = f"http://{ADDRESS}:{agent.port}"
    return f"metrics {base}/metrics · snapshot {base}/api/v1/snapshot"


def _phase_line(job: SimulatedJob, time_left: bool = True) -> str:
    where = job.position()
    if where is None:
        return "the schedule is over"
    position, into_s = where
    phase = job.schedule.phase(position)
    count = len(job.schedule.phases)
    length = f"{phase.seconds - into_s:.0f} s left" if time_left else f"{phase.seconds:g} s"
    return (f"phase {position % count + 1}/{count} {phase.kind.value} ({length}): "
            f"{describe(phase)}")


def _live(agent: Agent, job: SimulatedJob, options: DemoOptions, console: Console,
          stop: StopSignals) -> None:
    deadline = _deadline(options)

    def frame() -> RenderableType:
        header = Text(_phase_line(job), style="bold")
        footer = Text(f"{_urls(agent)} · Ctrl-C stops", style="dim")
        return Group(header, render(agent.snapshot(), title="gpumon demo"), footer)

    with Live(frame(), console=console, screen=True, auto_refresh=False) as live:
        while not stop.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
            live.update(frame(), refresh=True)


def _log(agent: Agent, job: SimulatedJob, options: DemoOptions, console: Console,
         stop: StopSignals) -> None:
    """One line per phase change, with the verdicts the agent reached during the last one."""
    deadline = _deadline(options)
    schedule = job.schedule
    console.print(f"gpumon demo: {options.gpus} simulated {job.source.model.name}, "
                  f"{options.ranks} ranks of run {RUN!r}; {schedule.source}: "
                  f"{len(schedule.phases)} phases, {schedule.seconds:g} s, repeating",
                  highlight=False, soft_wrap=True, markup=False)
    console.print(f"gpumon demo: {_urls(agent)} · steps on {agent.config.socket}",
                  highlight=False, soft_wrap=True, markup=False)
    started = time.monotonic()
    shown: int | None = None
    before: Counter[str] = Counter()
    while True:
        where = job.position()
        position = where[0] if where else None
        if position != shown:
            shown = position
            tally = _verdict_steps(agent.snapshot())
            since = tally - before
            before = tally
            verdicts = ", ".join(f"{k} {v}" for k, v in since.most_common()) or "none yet"
            console.print(f"[{time.monotonic() - started:6.1f}s] {_phase_line(job, False)} "
                          f"| agent's verdicts since the previous line (steps): {verdicts}",
                          highlight=False, soft_wrap=True, markup=False)
        if stop.wait(min(0.2, max(0.0, deadline - time.monotonic()))) \
                or time.monotonic() >= deadline:
            return


def _verdict_steps(snapshot: Mapping[str, Any]) -> Counter[str]:
    total: Counter[str] = Counter()
    for rank in snapshot.get("ranks", []):
        if rank.get("run") == RUN and rank.get("analysis"):
            total.update(rank["analysis"]["bottleneck_steps"])
    return total


def _steps(snapshot: Mapping[str, Any]) -> int:
    return sum(r.get("steps_total", 0) for r in snapshot.get("ranks", []) if r.get("run") == RUN)


__all__ = ["DemoError", "DemoOptions", "default_socket_path", "run_demo"]
