"""The page's section of a run that splits its model: each rank's place in the job's
parallelism, its own work per step and its bubble, and the pipeline stage that holds the others
back — as HTML from the model, whichever source filled it. ``page.py`` draws the bubble over
time beside it."""

from __future__ import annotations

import html

from gpumon.report.model import RunModel, slowest_stage
from gpumon.wire import ParallelLayout

PARALLEL_HEADING = "Model parallelism"
LAYOUT_ORDER = ("pp", "tp", "cp", "ep", "dp")
"""The pipeline stage first: the dimension along which ranks do different work, and wait."""
IMBALANCED = 1.25
"""GpumonPipelineImbalance's threshold: from here the slowest stage's line is a warning."""
CAPTION = ("Each rank's place in the job's parallelism, its own work per step (step time less "
           "its communication wait) and, for a rank that receives from another, its bubble: the "
           "share of its step time spent waiting to receive, over the run.")


def layout_text(layout: ParallelLayout) -> str:
    """A rank's place in its job's parallelism, compactly: ``pp1 dp0``, ``tp1``, a dimension of
    another name as the job named it (``shard2``)."""
    named = [(dim, getattr(layout, dim)) for dim in LAYOUT_ORDER
             if getattr(layout, dim) is not None]
    return " ".join(f"{dim}{index}" for dim, index in [*named, *sorted(layout.other)])


def slowest_stage_row(model: RunModel) -> list[tuple[str, str]]:
    """The summary's row naming a pipeline's slowest stage; none for a run without stages."""
    slowest = slowest_stage(model)
    if slowest is None:
        return []
    stage, _, ratio = slowest
    return [("slowest pipeline stage",
             f"stage {stage}: {ratio:.2f}× the stages' mean own work per step")]


def parallel_html(model: RunModel) -> str:
    """The caption, the slowest stage in words, and the table of the run's ranks (scrolling
    past 30 lines: a run may have 512)."""
    slowest = slowest_stage(model)
    out = f'<p class="caption">{html.escape(CAPTION)}</p>'
    if slowest is not None:
        stage, stage_own_s, ratio = slowest
        words = (f"Stage {stage} is the slowest pipeline stage: {stage_own_s:.3g} s of own work "
                 f"per step, {ratio:.2f}× the stages' mean; the other stages wait for it in "
                 "their bubble.")
        css = "note" if ratio >= IMBALANCED else "caption"
        out += f'<p class="{css}" id="slowest-stage">{html.escape(words)}</p>'
    bubbles = bool(model.bubble_share)
    heading = ["rank", "layout", "own work per step", *(["bubble"] if bubbles else []), ""]
    rows = ["<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in heading) + "</tr>"]
    for rank in model.ranks:
        layout = model.layouts.get(rank)
        own = model.own_work_s.get(rank)
        bubble = model.bubble_share.get(rank)
        cells = [f"rank {rank}", layout_text(layout) if layout else "—",
                 f"{own:.3g} s" if own is not None else "—",
                 *([f"{bubble:.0%}" if bubble is not None else "—"] if bubbles else [])]
        held_back = slowest is not None and layout is not None and layout.pp == slowest[0]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
                    + f'<td class="slowest">{"slowest stage" if held_back else ""}</td></tr>')
    return out + f'<div class="scroll"><table id="parallelism">{"".join(rows)}</table></div>'


__all__ = ["PARALLEL_HEADING", "layout_text", "parallel_html", "slowest_stage_row"]
