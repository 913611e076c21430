"""The page: a summary table and one plotly figure per question, in one HTML file.

plotly embeds its script once (``get_plotlyjs``), so the page opens with no network. Each
figure is drawn from the model's time bins, so no figure has more points than the page has
pixels across, whatever the run's length; a figure without data is left out and the page
says so.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from gpumon.report.goodput import (
    TIME_FIGURE,
    TIME_HEADING,
    goodput_rows,
    mark_restarts,
    time_figure,
)
from gpumon.report.model import (
    GPU_METRICS,
    LINK_METRICS,
    MEMORY_COMPONENTS,
    PHASES,
    Mean,
    Peak,
    RunModel,
    dominant,
    splits_model,
)
from gpumon.report.parallelism import (
    PARALLEL_HEADING,
    layout_text,
    parallel_html,
    slowest_stage_row,
)

GIB = 2**30
VERDICT_COLOURS = {
    "compute": "#2ca02c", "memory_bandwidth": "#17becf", "communication": "#9467bd",
    "input": "#ff7f0e", "host": "#d62728", "unknown": "#c7c7c7",
}
PHASE_COLOURS = {"data": "#ff7f0e", "forward": "#1f77b4", "backward": "#aec7e8",
                 "optimizer": "#2ca02c", "comm": "#9467bd", "other": "#c7c7c7"}
PHASE_NAMES = {"comm": "exposed comm"}
ROW_PX = (22, 1.5)
"""Pixels per rank of a per-rank strip: legible labels up to 32 ranks, one line each at 512."""
CONFIG = {"displaylogo": False, "responsive": True}


def _unit(model: RunModel) -> tuple[str, float]:
    """The time axis' unit: seconds for a short run, minutes, hours for a long one."""
    span = model.end - model.start
    return ("s", 1.0) if span < 300 else ("min", 60.0) if span < 18000 else ("h", 3600.0)


def _x(model: RunModel) -> list[float]:
    _, per = _unit(model)
    return [float(f"{t / per:.6g}") for t in model.times()]


def _y(series: Mean | Peak, scale: float = 1.0) -> list[float | None]:
    """A series' values in the figure's unit, to 5 significant digits: the page carries the
    figures, not the float noise of their sums (a third of its weight otherwise)."""
    return [float(f"{v * scale:.5g}") if v is not None else None for v in series.values()]


def _layout(fig: go.Figure, title: str, y: str, height: int = 360, *,
            model: RunModel) -> go.Figure:
    """The figures' common layout. The title is kept in the layout's ``meta`` and written
    above the figure as text (``render``), where it wraps on a narrow screen instead of
    running under the figure's buttons; the legend sits above the plot, clear of the x axis'
    title at any height (plotly widens the margin to fit it)."""
    fig.update_layout(meta={"caption": title}, height=height,
                      margin={"l": 70, "r": 30, "t": 60, "b": 50},  # (the top: the buttons, the legend)
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
                      template="plotly_white")
    fig.update_xaxes(title_text=f"{_unit(model)[0]} since the run's start", title_standoff=8)
    fig.update_yaxes(title_text=y)
    return fig


def _strip_height(ranks: int) -> int:
    per = ROW_PX[0] if ranks <= 32 else max(ROW_PX[1], 700 / ranks)
    return int(120 + ranks * per)


def phases_figure(model: RunModel) -> go.Figure | None:
    if not model.phases:
        return None
    fig = go.Figure()
    for name in PHASES:
        values = _y(model.phases[name]) if name in model.phases else []
        if not any(values):
            continue
        fig.add_trace(go.Scatter(x=_x(model), y=values, name=PHASE_NAMES.get(name, name),
                                 stackgroup="phases", mode="lines", line={"width": 0.5},
                                 fillcolor=PHASE_COLOURS[name], line_color=PHASE_COLOURS[name],
                                 hovertemplate="%{y:.4f} s"))
    return _layout(fig, "Step time by phase (mean over the ranks' steps)", "seconds per step",
                   model=model)


def verdicts_figure(model: RunModel) -> go.Figure | None:
    if not model.verdicts:
        return None
    names = list(VERDICT_COLOURS)
    ranks = sorted(model.verdicts)
    z, text = [], []
    for rank in ranks:
        row = [dominant(c) for c in model.verdicts[rank]]
        z.append([names.index(v) if v is not None else None for v in row])
        text.append([v or "" for v in row])
    scale = []
    for i, name in enumerate(names):
        scale += [[i / len(names), VERDICT_COLOURS[name]], [(i + 1) / len(names),
                                                           VERDICT_COLOURS[name]]]
    fig = go.Figure(go.Heatmap(x=_x(model), y=[f"rank {r}" for r in ranks], z=z, text=text,
                               zmin=0, zmax=len(names), colorscale=scale, showscale=False,
                               hovertemplate="%{y} · %{x}: %{text}<extra></extra>"))
    for name in names:  # a legend: the strips' colours by wall
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker={"color": VERDICT_COLOURS[name], "symbol": "square",
                                         "size": 12}))
    _layout(fig, "Verdict of each rank over time (the wall most of its steps hit)", "rank",
            _strip_height(len(ranks)), model=model)
    fig.update_yaxes(autorange="reversed", title_text="")
    return fig


def _colour_bar(ranks: int, title: str) -> dict[str, object]:
    """A colour bar legible beside a strip of a few ranks: as tall as the strip but at least
    120 px, its title at its side, and as many ticks as fit one per 30 px."""
    plot_px = _strip_height(ranks) - 120
    length_px = max(plot_px, 120)
    return {"title": {"text": title, "side": "right"}, "lenmode": "pixels", "len": length_px,
            "nticks": max(2, length_px // 30), "tickformat": ".3~g", "thickness": 14}


def step_heatmap(model: RunModel) -> go.Figure | None:
    if not model.step_time:
        return None
    ranks = sorted(model.step_time)
    stragglers = model.summary.stragglers
    labels = [f"rank {r} ⚠ straggler ({stragglers[r]})" if r in stragglers else f"rank {r}"
              for r in ranks]
    fig = go.Figure(go.Heatmap(
        x=_x(model), y=labels, z=[_y(model.step_time[r]) for r in ranks],
        colorscale="Viridis", colorbar=_colour_bar(len(ranks), "s / step"),
        hovertemplate="%{y} · %{x}: %{z:.4f} s<extra></extra>"))
    _layout(fig, "Step time per rank (stragglers named with their cause)", "rank",
            _strip_height(len(ranks)), model=model)
    fig.update_yaxes(autorange="reversed", title_text="")
    for rank, label in zip(ranks, labels, strict=True):
        if rank in stragglers:  # named beside the map too: among 512 rows its tick may be hidden
            fig.add_annotation(x=1.0, xref="paper", y=label, xanchor="right", showarrow=False,
                               text=f"◀ rank {rank}: straggler ({stragglers[rank]})",
                               bgcolor="rgba(255,255,255,0.8)", font={"color": "#d62728"})
    return fig


def memory_figure(model: RunModel) -> go.Figure | None:
    if not model.memory_peak:
        return None
    fig = go.Figure()
    x = _x(model)
    for name in MEMORY_COMPONENTS:
        mean = model.memory_components.get(name)
        if mean is None or not any(mean.counts):
            continue
        held = [(t, v) for t, v in zip(x, _y(mean, 1 / GIB), strict=True) if v is not None]
        fig.add_trace(go.Scatter(x=[t for t, _ in held], y=[v for _, v in held],
                                 name=f"rank {model.memory_rank}: {name}", stackgroup="memory",
                                 mode="lines", line={"width": 0.5}))
    many = len(model.memory_peak) > 16
    for rank, peak in sorted(model.memory_peak.items()):
        fig.add_trace(go.Scatter(x=x, y=_y(peak, 1 / GIB),
                                 name=f"rank {rank} peak", mode="lines", showlegend=not many,
                                 line={"width": 1}, connectgaps=True))
    if model.capacity_bytes:
        fig.add_hline(y=model.capacity_bytes / GIB, line_dash="dash", line_color="#d62728",
                      annotation_text=f"device memory {model.capacity_bytes / GIB:.0f} GiB")
    _layout(fig, "Memory per rank (per-step peak) and the breakdown nearest capacity", "GiB",
            420, model=model)
    fig.update_yaxes(rangemode="tozero")
    return fig


def _active(model: RunModel, metrics: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """The metrics of ``metrics`` that some GPU read above zero in some bin."""
    return [(k, title) for k, title in metrics
            if any(v for mean in model.gpu.get(k, {}).values() for v in mean.values())]


def gpu_idle(model: RunModel) -> bool:
    """The run has GPU samples, and every one read no activity and no traffic."""
    return bool(model.gpu) and not _active(model, GPU_METRICS) and not _active(model, LINK_METRICS)


def gpu_figure(model: RunModel) -> go.Figure | None:
    present = _active(model, GPU_METRICS)
    if not present:
        return None
    cols = min(2, len(present))
    rows = (len(present) + cols - 1) // cols
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[t for _, t in present],
                        shared_yaxes=True, vertical_spacing=0.18)
    for i, (key, _title) in enumerate(present):
        for gpu, mean in sorted(model.gpu[key].items()):
            fig.add_trace(go.Scatter(x=_x(model), y=_y(mean, 100),
                                     name=f"GPU {gpu}", legendgroup=f"gpu{gpu}",
                                     showlegend=i == 0, mode="lines", line={"width": 1}),
                          row=i // cols + 1, col=i % cols + 1)
    _layout(fig, "GPU activity per GPU", "% of the time", 60 + 260 * rows, model=model)
    fig.update_yaxes(range=[0, 105], title_text="")
    fig.update_yaxes(title_text="% of the time", col=1)
    return fig


def links_figure(model: RunModel) -> go.Figure | None:
    present = _active(model, LINK_METRICS)
    if not present:
        return None
    fig = go.Figure()
    for key, title in present:
        for gpu, mean in sorted(model.gpu[key].items()):
            fig.add_trace(go.Scatter(x=_x(model), y=_y(mean, 1 / 1e9),
                                     name=f"GPU {gpu} {title}", mode="lines",
                                     line={"width": 1}))
    return _layout(fig, "NVLink and PCIe traffic per GPU", "GB/s", 340, model=model)


def comm_figure(model: RunModel) -> go.Figure | None:
    if model.comm_exposed is None or model.comm_overlapped is None:
        return None
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    x = _x(model)
    fig.add_trace(go.Scatter(x=x, y=_y(model.comm_exposed), name="exposed (held the step)",
                             stackgroup="comm", mode="lines", line_color="#9467bd"))
    fig.add_trace(go.Scatter(x=x, y=_y(model.comm_overlapped),
                             name="overlapped (under compute)", stackgroup="comm",
                             mode="lines", line_color="#c5b0d5"))
    for op, mean in sorted(model.bus_bandwidth.items()):
        fig.add_trace(go.Scatter(x=x, y=_y(mean, 1 / 1e9),
                                 name=f"{op} bus bandwidth", mode="lines",
                                 line={"dash": "dot"}), secondary_y=True)
    _layout(fig, "Communication per step: exposed against overlapped, and bus bandwidth",
            "seconds per step", model=model)
    if model.bus_bandwidth:
        fig.update_yaxes(title_text="bus bandwidth, GB/s", secondary_y=True)
    return fig


def bubble_figure(model: RunModel) -> go.Figure | None:
    if not model.bubble:
        return None
    fig = go.Figure()
    many = len(model.bubble) > 16
    for rank, mean in sorted(model.bubble.items()):
        layout = model.layouts.get(rank)
        fig.add_trace(go.Scatter(x=_x(model), y=_y(mean, 100), mode="lines", showlegend=not many,
                                 name=f"rank {rank}" + (f" ({layout_text(layout)})" if layout
                                                        else ""),
                                 line={"width": 1}, connectgaps=True,
                                 hovertemplate="%{y:.1f} %"))
    _layout(fig, "Bubble per rank: the share of its step spent waiting to receive from another "
            "stage", "% of the step", 340, model=model)
    fig.update_yaxes(range=[0, 105])
    return fig


def _layer_key(layer: str) -> tuple[int, tuple[int, ...], str]:
    parts = layer.split(".")
    digits = all(p.isdigit() for p in parts)
    return (0 if digits else 1, tuple(int(p) for p in parts) if digits else (), layer)


def moe_figure(model: RunModel) -> go.Figure | None:
    """Layer x time of the busiest expert over the mean (the worst rank in each bin), and under
    it each rank's all-to-all seconds per step: the wait the busy experts' ranks cause."""
    if not model.moe_ratio:
        return None
    layers = sorted(model.moe_ratio, key=_layer_key)
    x = _x(model)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.6, 0.4],
                        vertical_spacing=0.08)
    fig.add_trace(go.Heatmap(
        x=x, y=[f"layer {layer}" for layer in layers], z=[_y(model.moe_ratio[layer]) for layer in layers],
        colorscale="OrRd", zmin=1, colorbar={"title": {"text": "busiest ÷ mean", "side": "right"},
                                            "len": 0.55, "y": 0.75, "thickness": 14},
        hovertemplate="%{y} · %{x}: %{z:.2f}× the mean<extra></extra>"), row=1, col=1)
    for rank, mean in sorted(model.all_to_all.items()):
        fig.add_trace(go.Scatter(x=x, y=_y(mean), mode="lines", name=f"rank {rank} all-to-all",
                                 showlegend=len(model.all_to_all) <= 16, line={"width": 1},
                                 connectgaps=True, hovertemplate="%{y:.4f} s"), row=2, col=1)
    _layout(fig, "MoE expert load per layer (its busiest expert over the mean over the ranks' "
            "last 50 steps, the worst rank; 1 is balanced), and each rank's all-to-all seconds "
            "per step", "", 300 + 22 * len(layers), model=model)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_yaxes(title_text="all-to-all, s / step", row=2, col=1)
    return fig


MOE_FIGURE = "moe"
MOE_HEADING = "Mixture of experts: expert load by layer, beside the all-to-all"
BUBBLE_FIGURE = "pipeline-bubble"
GPU_SECTIONS = ("gpu-activity", "links")
GPU_IDLE_NOTE = ("No GPU activity in this run: every GPU sample read 0 % busy and no NVLink or "
                 "PCIe traffic (a simulated node, or GPUs the job never used).")

FIGURES: tuple[tuple[str, str, Callable[[RunModel], go.Figure | None]], ...] = (
    ("step-phases", "Where the step time went", phases_figure),
    ("verdicts", "Which wall each rank hit", verdicts_figure),
    ("step-heatmap", "Which rank lagged, and when", step_heatmap),
    ("memory", "Memory towards the wall", memory_figure),
    ("gpu-activity", "GPU activity", gpu_figure),
    ("links", "NVLink and PCIe", links_figure),
    ("comm", "Communication", comm_figure),
)


LISTED = 8
"""Ranks a summary line names one by one; the rest are counted (a run may have 512)."""


def _listed(items: list[str], limit: int = LISTED) -> str:
    more = len(items) - limit
    return "; ".join(items[:limit]) + (f"; and {more} more" if more > 0 else "") or "none"


def _share(value: float) -> str:
    return "<1%" if 0 < value < 0.005 else f"{value:.0%}"


def _summary(model: RunModel) -> str:
    s = model.summary
    rows: list[tuple[str, str]] = [
        ("run", model.run), ("source", model.source),
        ("steps", f"{s.steps} over {s.ranks} ranks in {s.seconds / 60:.1f} min"),
    ]
    if s.samples_per_s is not None:
        rows.append(("throughput", f"{s.samples_per_s:,.1f} samples/s"
                     + (f", {s.tokens_per_s:,.0f} tokens/s" if s.tokens_per_s else "")))
    rows += goodput_rows(model)
    rows.append(("MFU", f"{s.mfu:.1%}" if s.mfu is not None else "not reported (no flops)"))
    rows.append(("steps per wall", ", ".join(f"{k} {_share(v)}" for k, v in s.walls.items())
                 or "no verdicts"))
    rows.append(("top hint", s.top_hint or "none"))
    rows.append(("stragglers", _listed([f"rank {r} ({c})" for r, c in s.stragglers.items()])))
    rows += slowest_stage_row(model)
    rows.append(("stalls", _listed([f"rank {r} ({t:.0f} s without a step)" for r, t in
                                    sorted(s.stalls.items(), key=lambda kv: -kv[1])])))
    rows.append(("OOM events", str(s.oom_events)))
    soonest = sorted(s.oom_prediction.items(), key=lambda kv: kv[1][0])
    rows.append(("OOM prediction", _listed([f"rank {r}: {text}" for r, (_, text) in soonest],
                                           limit=3)))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in rows)
    return f'<table id="summary">{body}</table>'


STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1400px;color:#222;
padding:0 12px}table{border-collapse:collapse}th{text-align:left;padding:2px 1em 2px 0;color:#555;
white-space:nowrap;font-weight:normal;vertical-align:top}td{padding:2px 0;overflow-wrap:anywhere}
.note{background:#fff3cd;padding:.5em 1em}h2{margin-top:1.5em;font-size:1.2em}
.caption{color:#444;margin:.2em 0}#parallelism td{padding:2px 1.5em 2px 0}
.slowest{color:#d62728;font-weight:bold}.scroll{max-height:30em;overflow:auto;margin-bottom:1em}
@media (max-width:600px){body{padding:0 6px}h1{font-size:1.3em}th{white-space:normal}}"""


def render(model: RunModel) -> str:
    """The whole page as one string; ``#gpumon-report`` lists the figures drawn and the time
    bins (the run's start in unix seconds, their width), for whoever reads the figures' data."""
    sections, missing, drawn = [], [], []
    idle = gpu_idle(model)
    fig = time_figure(model)  # a section for a run whose source accounted its time
    if fig is not None:
        drawn.append(TIME_FIGURE)
        sections.append(f"<h2>{html.escape(TIME_HEADING)}</h2>"
                        f'<p class="caption">{html.escape(fig.layout.meta["caption"])}</p>'
                        + fig.to_html(full_html=False, include_plotlyjs=False,
                                      div_id=TIME_FIGURE, config=CONFIG))
    for div_id, heading, build in FIGURES:
        fig = build(model)
        if fig is not None and div_id == "step-phases":
            mark_restarts(fig, model, _unit(model)[1])
        if fig is None:
            if idle and div_id in GPU_SECTIONS:
                sections.append(f"<h2>{html.escape(heading)}</h2>"
                                f'<p class="note">{html.escape(GPU_IDLE_NOTE)}</p>')
            else:
                missing.append(heading)
            continue
        drawn.append(div_id)
        caption = fig.layout.meta["caption"]
        sections.append(f"<h2>{html.escape(heading)}</h2>"
                        f'<p class="caption">{html.escape(caption)}</p>' + fig.to_html(
                            full_html=False, include_plotlyjs=False, div_id=div_id, config=CONFIG))
    if splits_model(model):  # a section of its own, left out of every other run's page
        section = f"<h2>{html.escape(PARALLEL_HEADING)}</h2>{parallel_html(model)}"
        fig = bubble_figure(model)
        if fig is not None:
            drawn.append(BUBBLE_FIGURE)
            section += (f'<p class="caption">{html.escape(fig.layout.meta["caption"])}</p>'
                        + fig.to_html(full_html=False, include_plotlyjs=False,
                                      div_id=BUBBLE_FIGURE, config=CONFIG))
        sections.append(section)
    fig = moe_figure(model)  # a section of its own, for a run with MoE layers only
    if fig is not None:
        drawn.append(MOE_FIGURE)
        sections.append(f"<h2>{html.escape(MOE_HEADING)}</h2>"
                        f'<p class="caption">{html.escape(fig.layout.meta["caption"])}</p>'
                        + fig.to_html(full_html=False, include_plotlyjs=False, div_id=MOE_FIGURE,
                                      config=CONFIG))
    notes = list(model.notes)
    if missing:
        notes.append("Not in this run's data, so not drawn: " + ", ".join(missing) + ".")
    note_html = "".join(f'<p class="note">{html.escape(n)}</p>' for n in notes)
    meta = json.dumps({"run": model.run, "figures": drawn, "start": model.start,
                       "bin_s": model.width_s, "bins": model.bins})
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>gpumon report: {html.escape(model.run)}</title><style>{STYLE}</style>"
            f"<script>{get_plotlyjs()}</script></head><body>"
            f"<h1>gpumon report: {html.escape(model.run)}</h1>{note_html}{_summary(model)}"
            f"{''.join(sections)}<script type=\"application/json\" id=\"gpumon-report\">"
            f"{meta}</script></body></html>")
