"""The parallelism part of ``gpumon top``: for a job that splits its model, each rank's place in
it (``pp1 dp0``), its own work per step, its bubble in a pipeline, and the stage that holds the
pipeline back — from the agent's snapshot, pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.table import Table
from rich.text import Text

IMBALANCED = 1.25
"""GpumonPipelineImbalance's threshold (alerts/gpumon.rules.yml): from here the slowest stage's
line is highlighted."""

_LAYOUT_ORDER = ("pp", "tp", "cp", "ep", "dp")
"""The pipeline stage first: the dimension along which ranks do different work, and wait."""


def layout_text(parallel: Mapping[str, Any] | None) -> str:
    """A rank's place in its job's parallelism, compactly: ``pp1 dp0``, ``tp1``, a dimension of
    another name as the job named it (``shard2``); empty when unknown."""
    parallel = parallel or {}
    named = [(dim, parallel[dim]) for dim in _LAYOUT_ORDER if parallel.get(dim) is not None]
    named += sorted((dim, index) for dim, index in parallel.items()
                    if dim not in _LAYOUT_ORDER and dim != "source")
    return " ".join(f"{dim}{index}" for dim, index in named)


def parallel_table(ranks: list[Mapping[str, Any]]) -> Table | None:
    """Each rank of a run that splits its model (a rank reports a layout or a bubble): its
    layout, own work per step and, in a pipeline, its bubble share; the slowest stage's ranks
    marked. A table of its own, so the rank table stays as wide as it was."""
    runs = {str(r.get("run")) for r in ranks
            if _analysis(r).get("parallel") or _analysis(r).get("bubble") is not None}
    shown = [r for r in ranks if str(r.get("run")) in runs]
    if not shown:
        return None
    bubbles = any(_analysis(r).get("bubble") is not None for r in shown)
    slowest = {run: stage for run, (stage, _, _) in slowest_stages(shown).items()}
    table = Table(title="Parallelism", title_justify="left", expand=False, pad_edge=False)
    for name in ("run", "rank", "layout", "own work", *(("bubble",) if bubbles else ()), ""):
        table.add_column(name, justify="left" if name in ("run", "layout", "") else "right",
                         no_wrap=True)
    for rank in shown:
        analysis = _analysis(rank)
        stage = (analysis.get("parallel") or {}).get("pp")
        held_back = stage is not None and slowest.get(str(rank.get("run"))) == stage
        table.add_row(str(rank.get("run", "")), str(rank.get("rank", "")),
                      layout_text(analysis.get("parallel")) or "—",
                      _seconds(analysis.get("own_work_seconds")),
                      *((_pct(analysis.get("bubble")),) if bubbles else ()),
                      Text("slowest stage", style="bold yellow") if held_back else "")
    return table


def slowest_stages(ranks: list[Mapping[str, Any]]) -> dict[str, tuple[int, float, float]]:
    """Per pipeline run of two stages or more: its slowest stage (the largest own work per
    step, the mean over the stage's ranks), that work, and its ratio to the stages' mean —
    over the ranks of ``ranks``, this agent's node (the recording rules see every node)."""
    work: dict[str, dict[int, list[float]]] = {}
    for rank in ranks:
        analysis = _analysis(rank)
        stage = (analysis.get("parallel") or {}).get("pp")
        own = analysis.get("own_work_seconds")
        if isinstance(stage, int) and isinstance(own, (int, float)):
            work.setdefault(str(rank.get("run")), {}).setdefault(stage, []).append(own)
    found: dict[str, tuple[int, float, float]] = {}
    for run, stages in work.items():
        means = {stage: sum(own) / len(own) for stage, own in stages.items()}
        mean = sum(means.values()) / len(means)
        if len(means) > 1 and mean > 0:
            stage = max(means, key=lambda s: (means[s], -s))
            found[run] = (stage, means[stage], means[stage] / mean)
    return found


def slowest_stage_lines(ranks: list[Mapping[str, Any]]) -> list[Text]:
    """One line per pipeline run: the stage that holds it back."""
    return [Text(f"{run}: stage {stage} is the slowest pipeline stage, {own:.2f} s of own work "
                 f"per step, {ratio:.2f}× the stages' mean; the other stages wait for it in "
                 "their bubble", style="bold yellow" if ratio >= IMBALANCED else "")
            for run, (stage, own, ratio) in sorted(slowest_stages(ranks).items())]


def _analysis(rank: Mapping[str, Any]) -> Mapping[str, Any]:
    return rank.get("analysis") or {}


def _pct(value: Any) -> str:
    return f"{value:.0%}" if isinstance(value, (int, float)) else "—"


def _seconds(value: Any) -> str:
    return f"{value:.2f} s" if isinstance(value, (int, float)) else "—"


__all__ = ["IMBALANCED", "layout_text", "parallel_table", "slowest_stage_lines", "slowest_stages"]
