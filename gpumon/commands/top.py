"""`gpumon top`: a live terminal view of an agent — GPUs, ranks, verdicts and OOM risk, and for
a job that splits its model, each rank's place in it and which pipeline stage holds it back.

``render`` turns one ``/api/v1/snapshot`` document into a rich renderable (pure, so tests
call it directly); ``run_top`` fetches the snapshot with urllib every interval and redraws,
until ``q`` or a signal; ``--once`` prints one frame for scripts.
``gpumon demo`` uses the same ``render`` on its in-process agent.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import termios
import time
import tty
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import IO, Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpumon.commands.memory_view import memory_table, select_rank
from gpumon.commands.parallel_view import parallel_table, slowest_stage_lines

GIB = 1024**3
SNAPSHOT_PATH = "/api/v1/snapshot"
_VERDICT_STYLES = {
    "compute": "green",
    "input": "yellow",
    "communication": "magenta",
    "memory_bandwidth": "cyan",
    "host": "red",
    "unknown": "dim",
}
_HIGH_RISK = 0.8  # gpumon.analysis.oom.HIGH_RISK: the agent's own "high"


def render(snapshot: Mapping[str, Any], title: str | None = None,
           rank: str | None = None) -> RenderableType:
    """The view of one snapshot: a header line, a GPU table, a rank table and the memory
    breakdown of the selected rank (``RUN:RANK``; default: the riskiest one that sends it)."""
    parts: list[RenderableType] = [_header(snapshot, title)]
    nvml = snapshot.get("nvml") or {}
    if not nvml.get("up", True):
        parts.append(Text(f"no GPU metrics: {nvml.get('message') or 'NVML unavailable'}",
                          style="yellow"))
    gpus = snapshot.get("gpus") or []
    if gpus:
        parts.append(_gpu_table(gpus))
    ranks = snapshot.get("ranks") or []
    if ranks:
        parts.append(_rank_table(ranks))
        parallel = parallel_table(ranks)
        if parallel is not None:
            parts.append(parallel)
            parts.extend(slowest_stage_lines(ranks))
        stalled = _stalled_places(ranks)
        if stalled is not None:
            parts.append(stalled)
        owners = _owners(ranks)
        if owners is not None:
            parts.append(owners)
        shown = select_rank(ranks, rank)
        if shown is not None:
            parts.append(memory_table(shown, _capacity(gpus, shown)))
        elif rank:
            parts.append(Text(f"rank {rank}: no memory breakdown (watch(model, optimizer) "
                              "sends it)", style="dim"))
    else:
        parts.append(Text("no training steps received yet: point gpumon.client.StepMonitor "
                          "at this agent's socket", style="dim"))
    return Group(*parts)


def _header(snapshot: Mapping[str, Any], title: str | None) -> Text:
    gpus = snapshot.get("gpus") or []
    nvml = snapshot.get("nvml") or {}
    text = Text(title or "gpumon top", style="bold")
    text.append(f"  gpumon {snapshot.get('version', '?')}")
    text.append(f"  {len(gpus)} GPU{'s' if len(gpus) != 1 else ''}")
    if nvml.get("simulated"):
        text.append(" (simulated)", style="yellow")
    elif nvml.get("driver_version"):
        text.append(f"  driver {nvml['driver_version']}")
    host = snapshot.get("host")
    if host:
        text.append(f"  host CPU {_pct(host.get('cpu_utilization_ratio'))}"
                    f"  memory {_gib(host.get('memory_used_bytes'))}"
                    f"/{_gib(host.get('memory_total_bytes'))} GiB")
    t = snapshot.get("t")
    if isinstance(t, (int, float)):
        text.append("  " + time.strftime("%H:%M:%S", time.localtime(t)))
    return text


def _gpu_table(gpus: list[Mapping[str, Any]]) -> Table:
    table = Table(title="GPUs", title_justify="left", expand=False, pad_edge=False)
    for name in ("GPU", "model", "util", "SM", "tensor", "DRAM", "memory GiB", "NVLink tx",
                 "power", "temp"):
        table.add_column(name, justify="left" if name == "model" else "right", no_wrap=True)
    for gpu in gpus:
        if not gpu.get("up", True):
            table.add_row(str(gpu.get("index")), str(gpu.get("model", "")),
                          Text("lost", style="bold red"), *[""] * 7)
            continue
        memory = (f"{_gib(gpu.get('memory_used_bytes'))}/{_gib(gpu.get('memory_total_bytes'))}")
        table.add_row(
            str(gpu.get("index")), str(gpu.get("model", "")),
            _pct(gpu.get("utilization_ratio")), _pct(gpu.get("sm_active_ratio")),
            _pct(gpu.get("tensor_active_ratio")), _pct(gpu.get("dram_active_ratio")),
            _memory_text(memory, gpu.get("memory_used_bytes"), gpu.get("memory_total_bytes")),
            _rate(gpu.get("nvlink_tx_bytes_per_second")),
            _unit(gpu.get("power_watts"), "W"), _unit(gpu.get("temperature_celsius"), "°C"),
        )
    return table


def _rank_table(ranks: list[Mapping[str, Any]]) -> Table:
    table = Table(title="Ranks", title_justify="left", expand=False, pad_edge=False)
    for name in ("run", "rank", "state", "GPU", "steps", "step", "verdict", "conf", "flags",
                 "MFU", "peak GiB", "OOM risk", "OOM in"):
        table.add_column(name, justify="left" if name in ("run", "state", "verdict", "flags")
                         else "right", no_wrap=True)
    for rank in ranks:
        analysis = rank.get("analysis") or {}
        verdict = analysis.get("bottleneck")
        oom = analysis.get("oom") or {}
        gpu = analysis.get("gpu")
        if gpu is None:
            gpu = rank.get("gpu")
        state = (rank.get("condition") or {}).get("state") or "—"
        table.add_row(
            str(rank.get("run", "")), str(rank.get("rank", "")),
            Text(state, style=_STATE_STYLES.get(state, "")),
            "—" if gpu is None else _short_gpu(gpu),
            str(rank.get("steps_total", "—")),
            _seconds(rank.get("last_step_duration_seconds")),
            Text(verdict or "—", style=_VERDICT_STYLES.get(verdict or "", "")),
            _pct(analysis.get("confidence")),
            _flags(analysis),
            _pct(analysis.get("mfu")),
            _gib(rank.get("memory_peak_bytes")),
            _risk(oom.get("risk_ratio")),
            _seconds(oom.get("predicted_seconds"), whole=True),
        )
    return table


_STATE_STYLES = {"stepping": "green", "evaluating": "cyan", "stalled": "bold red", "exited": "magenta",
                 "finished": "dim"}


def owner_text(owner: Mapping[str, Any] | None) -> str:
    """Whose a rank is, in words: its pod or Slurm job, user and node (what is known)."""
    owner = owner or {}
    parts = []
    if owner.get("pod"):
        container = f" ({owner['container']})" if owner.get("container") else ""
        parts.append(f"pod {owner.get('namespace')}/{owner['pod']}{container}")
    if owner.get("slurm_job"):
        step = f".{owner['slurm_step']}" if owner.get("slurm_step") else ""
        parts.append(f"Slurm job {owner['slurm_job']}{step}")
    if owner.get("user"):
        parts.append(f"user {owner['user']}")
    if owner.get("node"):
        parts.append(f"node {owner['node']}")
    return ", ".join(parts)


def _owners(ranks: list[Mapping[str, Any]]) -> Text | None:
    """One line per run and owner: which ranks are whose."""
    groups: dict[tuple[str, str], list[str]] = {}
    for rank in ranks:
        text = owner_text(rank.get("owner"))
        if text:
            groups.setdefault((str(rank.get("run")), text), []).append(str(rank.get("rank")))
    if not groups:
        return None
    out = Text("Whose:\n", style="bold")
    out.append("\n".join(f"{run} rank{'s' if len(r) > 1 else ''} {', '.join(r)}: {text}"
                         for (run, text), r in groups.items()))
    return out


def _stalled_places(ranks: list[Mapping[str, Any]]) -> Text | None:
    """One line per stalled rank: for how long, its phase and place, its collective, whom it
    waits on (``gpumon stacks`` shows the stacks)."""
    lines = []
    for rank in ranks:
        cond = rank.get("condition") or {}
        if cond.get("state") != "stalled":
            continue
        line = (f"{rank.get('run')} rank {rank.get('rank')}: stalled "
                f"{_seconds(cond.get('stalled_seconds'), whole=True)} in {cond.get('phase')} at "
                f"{cond.get('location')}")
        collective = cond.get("collective")
        if collective:
            line += f", in {collective.get('op')} #{collective.get('seq')}"
        if cond.get("waits_on_label"):
            line += f", waiting on rank(s) {cond['waits_on_label']}"
        lines.append(line)
    if not lines:
        return None
    text = Text("Stalled (gpumon stacks shows where):\n", style="bold red")
    text.append("\n".join(lines))
    return text


def _flags(analysis: Mapping[str, Any]) -> Text:
    """The rank's flags; the straggler's with its cause, and on the other ranks of its run
    the rank they wait on, so that the row to look at next is named."""
    words = []
    for flag in analysis.get("flags") or []:
        cause = analysis.get("straggler_cause")
        words.append(f"straggler ({cause})" if flag == "straggler" and cause else str(flag))
    waiting_on = analysis.get("waiting_on_rank")
    if waiting_on is not None and "straggler" not in (analysis.get("flags") or []):
        words.append(f"waits on rank {waiting_on}")
    return Text(", ".join(words), style="bold yellow") if words else Text("—", style="dim")


def _capacity(gpus: list[Mapping[str, Any]], rank: Mapping[str, Any]) -> Any:
    index = (rank.get("analysis") or {}).get("gpu")
    return next((g.get("memory_total_bytes") for g in gpus if g.get("index") == index), None)


def _pct(value: Any) -> str:
    return f"{value:.0%}" if isinstance(value, (int, float)) else "—"


def _gib(value: Any) -> str:
    return f"{value / GIB:.1f}" if isinstance(value, (int, float)) else "—"


def _rate(value: Any) -> str:
    return f"{value / 1e9:.1f} GB/s" if isinstance(value, (int, float)) else "—"


def _unit(value: Any, unit: str) -> str:
    return f"{value:.0f} {unit}" if isinstance(value, (int, float)) else "—"


def _seconds(value: Any, whole: bool = False) -> str:
    if not isinstance(value, (int, float)):
        return "—"
    return f"{value:.0f} s" if whole else f"{value:.2f} s"


def _memory_text(text: str, used: Any, total: Any) -> Text:
    if isinstance(used, (int, float)) and isinstance(total, (int, float)) and total > 0:
        share = used / total
        return Text(text, style="bold red" if share >= 0.9 else "yellow" if share >= 0.75 else "")
    return Text(text)


def _risk(value: Any) -> Text:
    if not isinstance(value, (int, float)):
        return Text("—")
    return Text(f"{value:.0%}",
                style="bold red" if value >= _HIGH_RISK else "yellow" if value >= 0.5 else "")


def _short_gpu(gpu: Any) -> str:
    text = str(gpu)
    return text if len(text) <= 12 else text[:8] + "…" + text[-3:]


def snapshot_url(url: str) -> str:
    """The snapshot endpoint of an agent's base URL; ValueError for anything but http(s)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--url {url!r}: expected the agent's address, "
                         "e.g. http://127.0.0.1:9403")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, SNAPSHOT_PATH, "", ""))


def fetch_snapshot(url: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """GET an agent's snapshot; OSError when unreachable, ValueError when not a snapshot."""
    with urllib.request.urlopen(snapshot_url(url), timeout=timeout_s) as response:
        data = json.loads(response.read())
    if not isinstance(data, dict) or "gpus" not in data:
        raise ValueError(f"{url} did not answer with a gpumon snapshot")
    return data


def _reason(exc: Exception) -> str:
    return str(exc.reason if isinstance(exc, urllib.error.URLError) else exc)


class StopSignals:
    """SIGINT and SIGTERM, and ``q`` typed on a terminal, ask to stop; ``wait`` sleeps until
    then or a timeout.

    The signal handlers only set a flag: the interpreter writes each signal's number to a
    pipe (``set_wakeup_fd``) that ``wait`` selects on beside the keyboard. Setting an Event
    from a handler can deadlock the main thread it interrupted (the Event's lock).
    """

    def __init__(self, keys: IO[str] | None = None) -> None:
        self.stopped = False
        self._keys = keys if keys is not None and keys.isatty() else None
        self._read_fd = self._write_fd = -1
        self._saved: dict[int, Any] = {}
        self._old_wakeup = -1
        self._old_tty: Any = None

    def __enter__(self) -> StopSignals:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.signal(sig, self._on_signal)
        if self._keys is not None:  # keys one by one, unechoed; restored on the way out
            self._old_tty = termios.tcgetattr(self._keys.fileno())
            tty.setcbreak(self._keys.fileno())
        return self

    def _on_signal(self, _signum: int, _frame: object) -> None:
        self.stopped = True

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; whether to stop."""
        watched = [self._read_fd] + ([self._keys.fileno()] if self._keys is not None else [])
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while not self.stopped:
            ready = select.select(watched, [], [], max(deadline - time.monotonic(), 0.0))[0]
            if self._read_fd in ready:
                os.read(self._read_fd, 64)  # the handler has run: ``stopped`` says
            if self._keys is not None and self._keys.fileno() in ready:
                if os.read(self._keys.fileno(), 64).lower().startswith(b"q"):
                    self.stopped = True
            if not ready or time.monotonic() >= deadline:
                break
        return self.stopped

    def __exit__(self, *_exc: object) -> None:
        if self._old_tty is not None and self._keys is not None:
            termios.tcsetattr(self._keys.fileno(), termios.TCSADRAIN, self._old_tty)
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._read_fd)
        os.close(self._write_fd)


def stop_on_signals(keys: IO[str] | None = None) -> StopSignals:
    """Stop on SIGINT or SIGTERM (and on ``q`` from ``keys``, a terminal), as a context
    manager for the main thread."""
    return StopSignals(keys)


def run_top(url: str, interval_s: float = 1.0, console: Console | None = None,
            once: bool = False, rank: str | None = None) -> int:
    """Show the agent at ``url`` every ``interval_s`` until ``q``, SIGINT or SIGTERM.

    On a terminal the view is redrawn in place; otherwise one frame is printed per interval.
    An agent that does not answer is said once, then tried again quietly every interval.
    With ``once``, one frame is printed and the exit status says whether the agent answered
    (0) or not (1).
    """
    snapshot_url(url)  # a bad URL fails now, not on every redraw
    console = console or Console()
    title = f"gpumon top {url}"
    if once:
        try:
            console.print(render(fetch_snapshot(url), title=title, rank=rank))
        except (OSError, ValueError) as exc:
            Console(stderr=True).print(f"gpumon top: no agent answers at {url}: "
                                       f"{_reason(exc)}", highlight=False, markup=False)
            return 1
        return 0
    with stop_on_signals(sys.stdin) as stop:
        if not console.is_terminal:
            _print_frames(url, title, interval_s, console, stop, rank)
            return 0
        footer = Text("q quits", style="dim")

        def frame() -> RenderableType:
            try:
                return Group(render(fetch_snapshot(url), title=title, rank=rank), footer)
            except (OSError, ValueError) as exc:
                return Group(Text(f"{title}: no agent answers ({_reason(exc)}); trying again "
                                  f"every {interval_s:g} s", style="yellow"), footer)

        with Live(frame(), console=console, screen=True, auto_refresh=False) as live:
            while not stop.wait(interval_s):
                live.update(frame(), refresh=True)
    return 0


def _print_frames(url: str, title: str, interval_s: float, console: Console,
                  stop: StopSignals, rank: str | None = None) -> None:
    """Not a terminal: a frame per interval; an agent not answering is said once."""
    said = False
    while True:
        try:
            snapshot = fetch_snapshot(url)
        except (OSError, ValueError) as exc:
            if not said:
                console.print(f"gpumon top: no agent answers at {url} ({_reason(exc)}); "
                              f"trying again every {interval_s:g} s", highlight=False,
                              markup=False, soft_wrap=True)
                said = True
        else:
            said = False
            console.print(render(snapshot, title=title, rank=rank))
        if stop.wait(interval_s):
            return


__all__ = ["StopSignals", "fetch_snapshot", "render", "run_top", "snapshot_url",
           "stop_on_signals"]
