"""The page's account of where the run's time went: its goodput ratio and largest loss in the
summary, each rank's time by cause as stacked bars, and its restarts marked on the time axis —
from the model's time figures, whichever source filled them (docs/goodput.md).

The ratio is goodput over settled time (goodput and every badput), summed over the ranks, as
the recording rules compute it: unsaved time is left out until it settles, so the page does not
guess whether a checkpoint or a failure will claim it. A run without time figures (a recording
made before the agent accounted time) gets no goodput row and no figure: no number is made up.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from gpumon.analysis.goodput import CAUSES
from gpumon.report.model import RunModel

TIME_FIGURE = "time-by-cause"
TIME_HEADING = "Where the run's time went"
PARTS = ("goodput", "unsaved", *CAUSES)
"""The bars' parts, left to right: kept, at risk, then each badput cause in CAUSES' order."""
PART_COLOURS = {
    "goodput": "#2ca02c", "unsaved": "#98df8a", "startup": "#1f77b4", "checkpoint": "#ff7f0e",
    "evaluation": "#9467bd", "stalled": "#d62728", "lost": "#8c564b", "restart": "#e377c2",
    "other": "#c7c7c7",
}
"""One colour per part, the same on every page."""
RESTART_COLOUR = "#e377c2"
GROUP_SHARE = 0.02
"""Restarts closer than this share of the time axis share one marker (a torchrun restart
starts every rank at once): their labels would overlap otherwise."""
LISTED = 8
"""Ranks a label or summary line names one by one; the rest are counted."""


@dataclass(frozen=True)
class RunTime:
    """The run's time, summed over its ranks, in rank-seconds."""

    goodput_s: float
    badput_s: dict[str, float]
    unsaved_s: float
    restarts: int

    @property
    def settled_s(self) -> float:
        """Goodput and every badput: the time whose fate is known."""
        return self.goodput_s + sum(self.badput_s.values())

    @property
    def ratio(self) -> float | None:
        """Goodput over settled time; ``None`` before any time settled."""
        return self.goodput_s / self.settled_s if self.settled_s > 0 else None

    def largest_loss(self) -> tuple[str, float] | None:
        """The cause that cost the most, and its seconds; ``None`` when nothing was lost (the
        first in CAUSES' order wins a tie)."""
        cause = max(CAUSES, key=lambda c: (self.badput_s.get(c, 0.0), -CAUSES.index(c)))
        seconds = self.badput_s.get(cause, 0.0)
        return (cause, seconds) if seconds > 0 else None


def run_time(model: RunModel) -> RunTime | None:
    """The run's time from its ranks' figures; ``None`` when the source had none."""
    if not model.time_totals:
        return None
    totals = model.time_totals.values()
    return RunTime(goodput_s=sum(t.goodput_s for t in totals),
                   badput_s={c: sum(t.badput_s.get(c, 0.0) for t in totals) for c in CAUSES},
                   unsaved_s=sum(t.unsaved_s for t in totals),
                   restarts=sum(t.restarts for t in totals))


def restarts(model: RunModel) -> list[tuple[float, int]]:
    """Every restart the figures keep the moment of: (unix time its successor started, rank),
    in time order."""
    return sorted((t, rank) for rank, totals in model.time_totals.items()
                  for t in totals.restarted_at)


def rank_hours(seconds: float) -> str:
    """Rank-time in the unit that reads best: rank-seconds, -minutes or -hours."""
    if seconds < 120:
        return f"{seconds:.3g} rank-seconds"
    if seconds < 7200:
        return f"{seconds / 60:.3g} rank-minutes"
    return f"{seconds / 3600:.3g} rank-hours"


def _ranks(ranks: list[int]) -> str:
    named = sorted(set(ranks))
    if len(named) == 1:
        return f"rank {named[0]}"
    more = len(named) - LISTED
    return "ranks " + ", ".join(str(r) for r in named[:LISTED]) + (
        f" and {more} more" if more > 0 else "")


def goodput_rows(model: RunModel) -> list[tuple[str, str]]:
    """The summary's rows of goodput and restarts; none for a run without time figures."""
    time = run_time(model)
    if time is None:
        return []
    ratio = time.ratio
    if ratio is None:
        text = "no time settled yet (no step kept or lost, nothing else counted)"
    else:
        text = f"Goodput {ratio:.0%} of {rank_hours(time.settled_s)}"
        largest = time.largest_loss()
        text += (f"; largest loss: {largest[0]} ({largest[1] / time.settled_s:.0%})"
                 if largest is not None else "; nothing lost")
    if time.unsaved_s > 0:
        text += f"; {rank_hours(time.unsaved_s)} unsaved, not counted until kept or lost"
    rows = [("goodput", text)]
    if time.restarts:
        restarted = [rank for rank, totals in model.time_totals.items() if totals.restarts]
        rows.append(("restarts", f"{time.restarts} ({_ranks(restarted)})"))
    return rows


def time_figure(model: RunModel) -> go.Figure | None:
    """Each rank's time as one horizontal bar, stacked by part in PARTS' order; a part no rank
    spent time in is left out of the legend."""
    if not model.time_totals:
        return None
    ranks = sorted(model.time_totals)
    longest = max(t.wall_s for t in model.time_totals.values())
    unit, per = ("s", 1.0) if longest < 300 else ("min", 60.0) if longest < 18000 else ("h", 3600.0)
    labels = [f"rank {r}" for r in ranks]
    fig = go.Figure()
    for part in PARTS:
        seconds = [_part(model, rank, part) for rank in ranks]
        if not any(seconds):
            continue
        fig.add_trace(go.Bar(y=labels, x=[float(f"{s / per:.5g}") for s in seconds],
                             name=part, orientation="h", marker_color=PART_COLOURS[part],
                             hovertemplate=f"%{{y}} · {part}: %{{x:.4g}} {unit}<extra></extra>"))
    per_rank = 22 if len(ranks) <= 32 else max(1.5, 700 / len(ranks))
    fig.update_layout(meta={"caption": (
        "Each rank's time by where it went: goodput (steps kept by a checkpoint or a clean "
        "finish), unsaved (steps not kept yet), then the badput by cause; restarts are marked "
        "on the step time figure below")},
        barmode="stack", height=int(140 + len(ranks) * per_rank), template="plotly_white",
        margin={"l": 70, "r": 30, "t": 60, "b": 50},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0, "traceorder": "normal"})
    fig.update_xaxes(title_text=f"{unit} of the rank's life", title_standoff=8)
    fig.update_yaxes(autorange="reversed")
    return fig


def _part(model: RunModel, rank: int, part: str) -> float:
    totals = model.time_totals[rank]
    if part == "goodput":
        return totals.goodput_s
    if part == "unsaved":
        return totals.unsaved_s
    return totals.badput_s.get(part, 0.0)


def restart_groups(model: RunModel) -> list[tuple[float, list[int]]]:
    """The restarts as markers: (unix time of the group's first, its ranks), restarts closer
    than ``GROUP_SHARE`` of the run's span joined (so at most 1 / GROUP_SHARE markers in the
    run, and more only for restarts outside it)."""
    close = GROUP_SHARE * max(model.end - model.start, 1e-9)
    groups: list[tuple[float, list[int]]] = []
    for t, rank in restarts(model):
        if groups and t - groups[-1][0] <= close:
            groups[-1][1].append(rank)
        else:
            groups.append((t, [rank]))
    return groups


def mark_restarts(fig: go.Figure, model: RunModel, unit_s: float) -> None:
    """A dashed vertical line on ``fig``'s time axis (seconds since the model's start over
    ``unit_s``) at each restart, labelled with the ranks that restarted there."""
    for t, ranks in restart_groups(model):
        fig.add_vline(x=float(f"{(t - model.start) / unit_s:.6g}"), line_dash="dash",
                      line_color=RESTART_COLOUR, line_width=1.5,
                      annotation_text=f"↻ {_ranks(ranks)}", annotation_position="top left",
                      annotation_font_color=RESTART_COLOUR)


__all__ = ["PARTS", "TIME_FIGURE", "TIME_HEADING", "RunTime", "goodput_rows", "mark_restarts",
           "restart_groups", "restarts", "run_time", "time_figure"]
