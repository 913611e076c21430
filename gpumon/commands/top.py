"""`gpumon top`: a live terminal view of an agent — GPUs, ranks, verdicts and OOM risk.

``render`` turns one ``/api/v1/snapshot`` document into a rich renderable (pure, so tests
call it directly); ``run_top`` fetches the snapshot with urllib every interval and redraws.
``gpumon demo`` uses the same ``render`` on its in-process agent.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpumon.commands.memory_view import memory_table, select_rank

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
    for name in ("run", "rank", "GPU", "steps", "step", "verdict", "conf", "flags", "MFU",
                 "peak GiB", "OOM risk", "OOM in"):
        table.add_column(name, justify="left" if name in ("run", "verdict", "flags") else "right",
                         no_wrap=True)
    for rank in ranks:
        analysis = rank.get("analysis") or {}
        verdict = analysis.get("bottleneck")
        oom = analysis.get("oom") or {}
        gpu = analysis.get("gpu")
        if gpu is None:
            gpu = rank.get("gpu")
        flags = analysis.get("flags") or []
        table.add_row(
            str(rank.get("run", "")), str(rank.get("rank", "")),
            "—" if gpu is None else _short_gpu(gpu),
            str(rank.get("steps_total", "—")),
            _seconds(rank.get("last_step_duration_seconds")),
            Text(verdict or "—", style=_VERDICT_STYLES.get(verdict or "", "")),
            _pct(analysis.get("confidence")),
            Text(", ".join(flags), style="bold yellow") if flags else Text("—", style="dim"),
            _pct(analysis.get("mfu")),
            _gib(rank.get("memory_peak_bytes")),
            _risk(oom.get("risk_ratio")),
            _seconds(oom.get("predicted_seconds"), whole=True),
        )
    return table


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


def _unreachable(url: str, exc: Exception) -> Text:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return Text(f"gpumon top: cannot read {url}: {reason}; retrying", style="yellow")


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGINT or SIGTERM while the block runs (main thread only)."""
    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda _signum, _frame: stop.set())
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_top(url: str, interval_s: float = 1.0, console: Console | None = None,
            rank: str | None = None) -> int:
    """Redraw the view of the agent at ``url`` every ``interval_s`` until SIGINT/SIGTERM.

    On a terminal the view is redrawn in place; otherwise one frame is printed per interval.
    """
    snapshot_url(url)  # a bad URL fails now, not on every redraw
    console = console or Console()
    title = f"gpumon top {url}"

    def frame() -> RenderableType:
        try:
            return render(fetch_snapshot(url), title=title, rank=rank)
        except (OSError, ValueError) as exc:
            return _unreachable(url, exc)

    with stop_on_signals() as stop:
        if not console.is_terminal:
            while True:
                console.print(frame())
                if stop.wait(interval_s):
                    return 0
        with Live(frame(), console=console, screen=True, auto_refresh=False) as live:
            while not stop.wait(interval_s):
                live.update(frame(), refresh=True)
    return 0


__all__ = ["fetch_snapshot", "render", "run_top", "snapshot_url", "stop_on_signals"]
