"""The memory-breakdown part of ``gpumon top``: one rank's memory by component, what ZeRO would
make of it, and what the OOM warning names — from the agent's snapshot, pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

from gpumon.analysis.memory import PROJECTION_SCALES, ZERO_STAGES, project_zero
from gpumon.wire import MEMORY_COMPONENTS, MemoryBreakdown

GIB = 1024**3


def select_rank(ranks: Sequence[Mapping[str, Any]],
                selected: str | None) -> Mapping[str, Any] | None:
    """The rank to show: ``selected`` (``RUN:RANK``, or just ``RANK``) when it sent a
    breakdown, else the one with the highest OOM risk among those that did."""
    with_breakdown = [r for r in ranks if r.get("memory_breakdown")]
    if selected:
        run, _, rank = selected.rpartition(":")
        for r in with_breakdown:
            if str(r.get("rank")) == rank and (not run or r.get("run") == run):
                return r
        return None
    if not with_breakdown:
        return None
    return max(with_breakdown, key=lambda r: ((r.get("analysis") or {}).get("oom") or {})
               .get("risk_ratio") or 0.0)


def parse_rank(selected: str) -> str:
    """``selected`` if it reads as ``RUN:RANK`` or ``RANK``; ValueError otherwise."""
    rank = selected.rpartition(":")[2]
    if not rank.isdigit():
        raise ValueError(f"--rank {selected!r}: expected RUN:RANK or RANK, e.g. llm:0")
    return selected


def memory_table(rank: Mapping[str, Any], capacity_bytes: float | None = None) -> Table:
    """One rank's breakdown (GiB and share), its ZeRO projections and the named component."""
    parts = rank.get("memory_breakdown") or {}
    breakdown = MemoryBreakdown(**{k: parts.get(k) for k in MEMORY_COMPONENTS})
    world = int(rank.get("world") or 1)
    title = f"Memory of {rank.get('run')} rank {rank.get('rank')} (sampled)"
    table = Table(title=title, title_justify="left", expand=False, pad_edge=False)
    table.add_column("component", no_wrap=True)
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    total = sum(v for v in (getattr(breakdown, k) for k in MEMORY_COMPONENTS) if v)
    named = ((rank.get("analysis") or {}).get("memory") or {}).get("component")
    for name in MEMORY_COMPONENTS:
        value = getattr(breakdown, name)
        style = "bold yellow" if name == named else ""
        table.add_row(Text(name.replace("_", " "), style=style),
                      "—" if value is None else f"{value / GIB:.2f}",
                      "—" if value is None or not total else f"{value / total:.0%}")
    table.add_row(Text("total", style="bold"), f"{total / GIB:.2f}", "")
    if capacity_bytes:
        table.add_row("GPU capacity", f"{capacity_bytes / GIB:.1f}", "")
    projections = {(p.stage, p.gpus): p.total for p in project_zero(breakdown, world)}
    for scale in PROJECTION_SCALES:
        gpus = world * scale
        cells = "  ".join(f"Z{stage} {projections[(stage, gpus)] / GIB:.2f}"
                          for stage in ZERO_STAGES)
        table.add_row(f"ZeRO on {gpus} GPU{'s' if gpus > 1 else ''}", cells, "")
    memory = (rank.get("analysis") or {}).get("memory")
    if memory:
        table.caption = (f"{memory['component']} {memory['cause']}: {memory['remedy']}")
        table.caption_justify = "left"
    return table
