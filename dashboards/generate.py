"""Write the gpumon Grafana dashboards (dashboards/*.json) from the panel lists below.

Run ``python dashboards/generate.py`` after editing; tests/e2e/test_dashboards.py fails when the
checked-in JSON differs from what this script writes, and runs every query against a real
Prometheus. Every panel and target uses the ``${datasource}`` variable: no data source uid is
ever written into a dashboard.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCHEMA_VERSION = 39  # Grafana 10.4
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"


@dataclass
class Target:
    """One PromQL query of a panel."""

    expr: str
    legend: str = ""
    instant: bool = False
    format: str = "time_series"


@dataclass
class Panel:
    """A panel before layout: its kind, title, queries and field defaults."""

    kind: str
    title: str
    description: str
    targets: list[Target]
    unit: str = "short"
    width: int = 12
    height: int = 8
    min: float | None = 0
    max: float | None = None
    thresholds: list[tuple[float | None, str]] = field(default_factory=list)
    stack: str = "none"
    options: dict[str, Any] = field(default_factory=dict)
    overrides: list[dict[str, Any]] = field(default_factory=list)
    repeat: str | None = None
    """A multi-value variable: one copy of the panel per selected value."""
    mappings: list[dict[str, Any]] = field(default_factory=list)
    """Grafana value mappings: a number shown as a word, in a colour."""
    draw: str = "line"
    """How a time series is drawn: ``line``, or ``bars`` for counts per interval."""


def timeseries(title: str, description: str, *targets: Target, **kw: Any) -> Panel:
    """A time-series graph."""
    return Panel("timeseries", title, description, list(targets), **kw)


def stat(title: str, description: str, target: Target, **kw: Any) -> Panel:
    """A single big number (the last value of an instant query)."""
    kw.setdefault("width", 4)
    kw.setdefault("height", 4)
    return Panel("stat", title, description, [target], **kw)


def table(title: str, description: str, *targets: Target, **kw: Any) -> Panel:
    """A table of instant-query results, one row per series."""
    for t in targets:
        t.instant, t.format = True, "table"
    return Panel("table", title, description, list(targets), **kw)


def row(title: str) -> Panel:
    """A row header across the dashboard."""
    return Panel("row", title, "", [], width=24, height=1)


def _thresholds(steps: list[tuple[float | None, str]]) -> dict[str, Any]:
    steps = steps or [(None, "green")]
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def _target(t: Target, ref: str) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE, "refId": ref, "expr": t.expr, "legendFormat": t.legend,
        "range": not t.instant, "instant": t.instant, "format": t.format, "editorMode": "code",
    }


def _panel(p: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    out: dict[str, Any] = {"id": panel_id, "type": p.kind, "title": p.title,
                           "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y}}
    if p.kind == "row":
        return {**out, "collapsed": False, "panels": []}
    defaults: dict[str, Any] = {"unit": p.unit, "thresholds": _thresholds(p.thresholds),
                                "color": {"mode": "thresholds" if p.kind == "stat" else
                                          "palette-classic"}}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    if p.mappings:
        defaults["mappings"] = p.mappings
    options: dict[str, Any] = {}
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": p.draw, "lineWidth": 1, "fillOpacity": 10,
                              "showPoints": "never", "spanNulls": False,
                              "stacking": {"mode": p.stack, "group": "A"},
                              "thresholdsStyle": {"mode": "dashed" if p.thresholds else "off"}}
        if p.thresholds:
            defaults["color"] = {"mode": "palette-classic"}
        options = {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                              "calcs": ["lastNotNull", "max"]},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    elif p.kind == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "area", "textMode": "auto",
                   "justifyMode": "auto", "orientation": "auto"}
    elif p.kind == "table":
        defaults["custom"] = {"align": "auto", "cellOptions": {"type": "color-text"}}
        options = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    elif p.kind == "status-history":
        defaults["color"] = {"mode": "continuous-GrYlRd"}
        defaults["custom"] = {"fillOpacity": 90, "lineWidth": 0}
        options = {"showValue": "never", "rowHeight": 0.9, "colWidth": 0.9,
                   "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                   "tooltip": {"mode": "single", "sort": "none"}}
    elif p.kind == "heatmap":
        options = {"calculate": False, "cellGap": 1,
                   "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64,
                             "exponent": 0.5, "fill": "dark-orange", "reverse": False},
                   "yAxis": {"axisPlacement": "left", "unit": p.unit},
                   "rowsFrame": {"layout": "auto"}, "cellValues": {"unit": "short"},
                   "tooltip": {"show": True, "yHistogram": True}, "legend": {"show": True},
                   "filterValues": {"le": 1e-9}}
    options.update(p.options)
    transformations = []
    if p.kind == "table":
        transformations = [{"id": "merge", "options": {}},
                           {"id": "organize", "options": {"excludeByName": {"Time": True}}}]
    if p.repeat:
        out.update({"repeat": p.repeat, "repeatDirection": "h", "maxPerRow": 2})
    return {**out, "description": p.description, "datasource": DATASOURCE,
            "fieldConfig": {"defaults": defaults, "overrides": p.overrides}, "options": options,
            "targets": [_target(t, chr(ord("A") + i)) for i, t in enumerate(p.targets)],
            **({"transformations": transformations} if transformations else {})}


def _layout(panels: list[Panel]) -> list[dict[str, Any]]:
    """Flow panels left to right in 24 columns, a row header starting a new line."""
    out, x, y, line_height = [], 0, 0, 0
    for panel_id, p in enumerate(panels, start=1):
        if p.kind == "row" or x + p.width > 24:
            x, y, line_height = 0, y + line_height, 0
        out.append(_panel(p, panel_id, x, y))
        if p.kind == "row":
            y += 1
            continue
        x += p.width
        line_height = max(line_height, p.height)
    return out


def datasource_variable() -> dict[str, Any]:
    """The data source picker every panel refers to."""
    return {"name": "datasource", "label": "Data source", "type": "datasource",
            "query": "prometheus", "regex": "", "hide": 0, "refresh": 1,
            "current": {}, "options": []}


def query_variable(name: str, label: str, query: str, *, multi: bool = False,
                   all_value: str | None = ".*") -> dict[str, Any]:
    """A variable filled from ``label_values(...)``; multi ones offer All: ``all_value``, or
    with ``None`` Grafana's own, the listed values joined (``(a|b)``)."""
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "definition": query, "refresh": 2, "sort": 3, "regex": "", "hide": 0,
            "multi": multi, "includeAll": multi,
            **({"allValue": all_value} if multi and all_value is not None else {}),
            "current": {}, "options": []}


def dashboard(uid: str, title: str, description: str, variables: list[dict[str, Any]],
              panels: list[Panel]) -> dict[str, Any]:
    """A whole dashboard with the datasource variable first."""
    return {
        "uid": uid, "title": title, "description": description, "tags": ["gpumon"],
        "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True, "graphTooltip": 1,
        "timezone": "browser", "refresh": "30s", "time": {"from": "now-3h", "to": "now"},
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["gpumon"], "asDropdown": True,
                   "includeVars": False, "keepTime": True, "title": "gpumon dashboards"}],
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": _layout(panels),
    }


# --- Training run ---------------------------------------------------------------------------

RUN = 'run=~"$run",rank=~"$rank"'
RUN_ONLY = 'run=~"$run"'
OWNERS = 'namespace=~"$namespace",pod=~"$pod",slurm_job=~"$slurm_job"'


def _owner_variables() -> list[dict[str, Any]]:
    """Namespace, pod and Slurm job, from gpumon_rank_info: they narrow the runs offered. All is
    ``.*``, which also matches the empty value of a rank outside Kubernetes or Slurm."""
    return [
        query_variable("namespace", "Namespace", "label_values(gpumon_rank_info, namespace)",
                       multi=True),
        query_variable("pod", "Pod", 'label_values(gpumon_rank_info{namespace=~"$namespace"}, pod)',
                       multi=True),
        query_variable("slurm_job", "Slurm job", "label_values(gpumon_rank_info, slurm_job)",
                       multi=True),
    ]


def _share(phase: str) -> str:
    return (f'sum by (rank) (rate(gpumon_step_phase_seconds_total{{{RUN},phase="{phase}"}}[{RATE}]))'
            f'\n  / sum by (rank) (rate(gpumon_step_duration_seconds_sum{{{RUN}}}[{RATE}]))')


def _per_step(counter: str) -> str:
    return (f"sum by (rank) (rate({counter}{{{RUN}}}[{RATE}]))"
            f"\n  / sum by (rank) (rate(gpumon_steps_total{{{RUN}}}[{RATE}]))")


def _communication_panels() -> list[Panel]:
    """Collectives per rank, and the straggler its peers wait for."""
    return [
        row("Communication and stragglers"),
        timeseries("Communication overlap per rank", "Seconds per step each rank was blocked "
                   "on collectives (exposed) and had them in flight while it kept computing "
                   "(overlapped). Overlap is free; exposed time lengthens every step.",
                   Target(_per_step("gpumon_comm_exposed_seconds_total"), "rank {{rank}} exposed"),
                   Target(_per_step("gpumon_comm_overlapped_seconds_total"),
                          "rank {{rank}} overlapped"), unit="s"),
        timeseries("Bus bandwidth per rank", "Achieved bus bandwidth of each kind of collective "
                   "over the rank's last 16 steps (nccl-tests' definition: all-reduce "
                   "bytes / time × 2(n−1)/n), to compare with the links' peak.",
                   Target(f"gpumon_collective_bus_bandwidth_bytes_per_second{{{RUN}}}",
                          "rank {{rank}} {{op}}"), unit="Bps"),
        timeseries("Collective traffic by kind", "Collective payload per second over the "
                   "selected ranks, by kind (all_reduce, reduce_scatter, all_gather, ...).",
                   Target(f"sum by (op) (rate(gpumon_collective_bytes_total{{{RUN}}}[{RATE}]))",
                          "{{op}}"), unit="Bps"),
        table("Slowest rank and why", "The run's lowest straggler score, whichever ranks are "
              "selected (its peers' own work per step ÷ its own; under 0.75 it is the straggler "
              "the others wait for), and the cause its agent names: input (its data wait), "
              "compute (its own forward/backward work) or gpu (throttled, lower clocks, XID).",
              Target(f"bottomk by (run) (1, run_rank:gpumon_rank_straggler_score:ratio1m{{{RUN_ONLY}}})"),
              Target(f"max by (run, rank, cause) (gpumon_rank_straggler_cause{{{RUN_ONLY}}} == 1)"),
              thresholds=[(None, "red"), (0.75, "green")]),
        timeseries("Straggler score", "A rank's peers' mean own work per step (step time "
                   "less collective wait) over its own (1 = like its peers, under 0.75 = "
                   "straggler): run-wide for each node's slowest rank, whichever ranks are "
                   "selected (the recording rule scores no other), and the agent's node-local "
                   "score of the selected ranks.",
                   Target(f"run_rank:gpumon_rank_straggler_score:ratio1m{{{RUN_ONLY}}}",
                          "rank {{rank}} (run-wide)"),
                   Target(f"gpumon_rank_straggler_score{{{RUN}}}", "rank {{rank}} (node)"),
                   thresholds=[(None, "red"), (0.75, "green")], width=24),
    ]


def _parallelism_panels() -> list[Panel]:
    """Where each rank sits in a job that splits its model, and which pipeline stage holds the
    pipeline back."""
    stage_ratio = "run_pp:gpumon_pipeline_stage_imbalance_ratio:ratio1m"
    return [
        row("Model parallelism"),
        table("Layout per rank", "Each rank's index along each dimension of its job's "
              "parallelism: data (dp), tensor (tp), pipeline stage (pp), expert (ep), context "
              "(cp), where its hook found them (a DeviceMesh, the pipeline stage, DeepSpeed's "
              "grid, Megatron, StepMonitor(parallel=...)); no column for a dimension the job "
              "lacks. A rank is compared with its data-parallel replicas, the ranks that share "
              "every other index; a rank not listed is compared with its run.",
              Target(f"max by (rank, dp, tp, pp, ep, cp) (gpumon_rank_parallel_info{{{RUN}}})"),
              width=8),
        timeseries("Pipeline imbalance (slowest stage)", "The slowest pipeline stage's own "
                   "work per step (step time less collective wait) over the mean of the run's "
                   "stages, named in the legend, over every node: the pipeline moves at its "
                   "pace, the other stages wait for it in their bubble. 1 is balanced; from "
                   "1.25 for 10 minutes GpumonPipelineImbalance fires: move layers off that "
                   "stage.",
                   Target(f"{stage_ratio}{{{RUN_ONLY}}}\n  == on (run) group_left ()"
                          f"\n  run:gpumon_pipeline_stage_imbalance_ratio:ratio1m{{{RUN_ONLY}}}",
                          "slowest: stage {{pp}}"),
                   min=1, thresholds=[(None, "green"), (1.25, "red")], width=16),
        timeseries("Own work per pipeline stage", "Each stage's own work per step (step time "
                   "less collective wait), the mean over the stage's ranks on every node: the "
                   "highest line is the stage the others wait for.",
                   Target(f"run_pp:gpumon_pipeline_stage_own_seconds:mean1m{{{RUN_ONLY}}}",
                          "stage {{pp}}"), unit="s"),
        timeseries("Pipeline bubble per rank", "Share of each rank's step time spent waiting "
                   "to receive from the neighbouring stage (its bubble, part of its exposed "
                   "communication). Every stage but the slowest waits; a bubble on every stage "
                   "calls for more micro-batches per step or an interleaved schedule.",
                   Target(f"sum by (rank) (rate(gpumon_pipeline_bubble_seconds_total{{{RUN}}}[{RATE}]))"
                          f"\n  / sum by (rank) (rate(gpumon_step_duration_seconds_sum{{{RUN}}}[{RATE}]))",
                          "rank {{rank}}"), unit="percentunit", max=1),
    ]


def _moe_panels() -> list[Panel]:
    """Each MoE layer's expert load, layer x time, beside the all-to-all it makes ranks wait in."""
    a2a = 'op="all_to_all"'
    return [
        row("Mixture of experts"),
        Panel("status-history", "MoE expert load by layer (busiest expert ÷ mean)",
              "For each MoE layer, over every node, the busiest expert's tokens over the mean "
              "per expert in the ranks' last 50 steps (1 = balanced; docs/moe.md). A layer "
              "that stays at 2 or more, or has experts with no token, fires "
              "GpumonExpertImbalance: the ranks holding its busy experts compute while the "
              "others wait in the all-to-all (the panel beside).",
              [Target(f"run_layer:gpumon_moe_expert_load_max_ratio:max{{{RUN_ONLY}}}",
                      "layer {{layer}}")], min=1, width=12,
              thresholds=[(None, "green"), (1.5, "yellow"), (2, "red")]),
        timeseries("All-to-all time and exposed communication per rank",
                   "Seconds per step each rank's all-to-alls were in flight (the MoE dispatch "
                   "and combine), and its exposed communication (blocked on any collective). A "
                   "rank whose experts are the busy ones waits least: its peers' exposed time "
                   "is their wait for it.",
                   Target(f"sum by (rank) (rate(gpumon_collective_seconds_total{{{RUN},{a2a}}}[{RATE}]))"
                          f"\n  / sum by (rank) (rate(gpumon_steps_total{{{RUN}}}[{RATE}]))",
                          "rank {{rank}} all-to-all"),
                   Target(_per_step("gpumon_comm_exposed_seconds_total"), "rank {{rank}} exposed"),
                   unit="s"),
        timeseries("Dead experts per layer", "Experts of each MoE layer that received no token "
                   "in the rank's last 50 steps, the most over the selected ranks: they get no "
                   "gradient and stop learning.",
                   Target(f"max by (layer) (gpumon_moe_dead_experts{{{RUN}}})", "layer {{layer}}"),
                   thresholds=[(None, "green"), (1, "red")]),
        timeseries("MoE expert load CV per layer", "Coefficient of variation of the tokens "
                   "per expert of each layer over the rank's last 50 steps, the most over the "
                   "selected ranks (0 = balanced).",
                   Target(f"max by (layer) (gpumon_moe_expert_load_cv{{{RUN}}})", "layer {{layer}}")),
    ]


def _rank_state_panels() -> list[Panel]:
    """Whether each rank steps, and where a stalled run's ranks are."""
    states = {"0": ("stepping", "green"), "1": ("stalled", "red"), "2": ("exited", "purple")}
    return [
        row("Rank state"),
        Panel("status-history", "Rank state",
              "Each rank: stepping, stalled (no step for longer than its hook's threshold, or "
              "its hook silent while its process lives) or exited (its process ended). Where "
              "a stalled rank is: the table beside, or gpumon stacks.",
              [Target(f'sum by (rank) (gpumon_rank_state{{{RUN},state="stalled"}})'
                      f'\n  + 2 * sum by (rank) (gpumon_rank_state{{{RUN},state="exited"}})',
                      "rank {{rank}}")],
              max=2, mappings=[{"type": "value", "options": {
                  value: {"text": text, "color": color, "index": int(value)}
                  for value, (text, color) in states.items()}}]),
        table("Where stalled ranks are", "While a rank is stalled: its open phase, the "
              "collective it is in, the innermost frame of the job's own code, the ranks it "
              "waits on (GpumonTrainingStalled names them too), and for how long.",
              Target(f"max by (rank, phase, op, location, waits_on) "
                     f"(gpumon_rank_stall_info{{{RUN}}})"),
              Target(f"max by (rank) (gpumon_rank_stalled_seconds{{{RUN}}} > 0)")),
    ]


def _goodput_panels() -> list[Panel]:
    """Where the run's time went (docs/goodput.md): what was kept, what was lost and to what,
    what is at risk now, and the restarts and checkpoints behind it."""
    def ratio(window: str) -> str:
        return f"run:gpumon_goodput:ratio_rate{window}{{{RUN_ONLY}}}"

    good = [(None, "red"), (0.7, "orange"), (0.9, "green")]
    return [
        row("Where the time went"),
        stat("Goodput ratio (6 h)", "Share of the run's settled time over 6 hours that was "
             "kept: step time a checkpoint preserved, over that plus badput (startup, "
             "checkpoints, evaluation, stalls, lost work, restarts). Under 70 % for 30 "
             "minutes fires GpumonGoodputLow.",
             Target(ratio("6h")), unit="percentunit", max=1, thresholds=good),
        stat("Goodput ratio (1 d)", "The same over the last day.",
             Target(ratio("1d")), unit="percentunit", max=1, thresholds=good),
        timeseries("Goodput ratio over time", "The run's goodput ratio over the last hour, "
                   "6 hours and day; 0.7 marked (GpumonGoodputLow reads the 6-hour one).",
                   Target(ratio("1h"), "1 h"), Target(ratio("6h"), "6 h"),
                   Target(ratio("1d"), "1 d"), unit="percentunit", max=1,
                   thresholds=[(None, "red"), (0.7, "green")], width=16),
        timeseries("Time by cause", "Where the ranks' settled time goes, in seconds per "
                   "second summed over the run's ranks (8 ranks training: 8): goodput, and "
                   "badput by cause. Goodput arrives when a checkpoint completes (it preserves "
                   "the steps before it); the unsaved panel holds what is not settled yet.",
                   Target(f"run:gpumon_goodput_seconds:rate5m{{{RUN_ONLY}}}", "goodput"),
                   Target(f"run_cause:gpumon_badput_seconds:rate5m{{{RUN_ONLY}}}", "{{cause}}"),
                   stack="normal"),
        timeseries("Unsaved work per rank", "Step time each rank has done since its last "
                   "preserved point: lost if it fails now, goodput at its next checkpoint. "
                   "Beyond its agent's threshold (the alert threshold line) for 10 minutes fires "
                   "GpumonWorkAtRisk.",
                   Target(f"gpumon_unsaved_seconds{{{RUN}}}", "rank {{rank}}"),
                   Target(f"max(gpumon_unsaved_threshold_seconds\n  and on (job, instance)"
                          f" gpumon_unsaved_seconds{{{RUN}}})", "alert threshold"),
                   unit="s"),
        timeseries("Rank restarts", "Ranks continued by a new process after the old one "
                   "exited (a torchrun restart, a Slurm requeue, a pod restarted under the same "
                   "job), per interval.",
                   Target(f"sum by (rank) (increase(gpumon_rank_restarts_total{{{RUN}}}[{RATE}]))",
                          "rank {{rank}}"), draw="bars"),
        timeseries("Checkpoints", "Saves and loads per interval over the selected ranks, by "
                   "result; a failed save leaves the work since the last one at risk.",
                   Target(f"sum by (kind, result) "
                          f"(increase(gpumon_checkpoints_total{{{RUN}}}[{RATE}]))",
                          "{{kind}} {{result}}"), draw="bars"),
    ]


def training() -> dict[str, Any]:
    """One run: speed, where each step's time goes, verdicts and memory."""
    q = f"sum by (le) (rate(gpumon_step_duration_seconds_bucket{{{RUN}}}[{RATE}]))"
    panels = [
        row("Overview"),
        stat("Step time p50", "Median wall time of a step over the selected ranks.",
             Target(f"histogram_quantile(0.5, {q})"), unit="s"),
        stat("Samples / s", "Samples processed per second, summed over the selected ranks.",
             Target(f"sum(rate(gpumon_samples_total{{{RUN}}}[{RATE}]))"), unit="short"),
        stat("Tokens / s", "Tokens processed per second, summed over the selected ranks.",
             Target(f"sum(rate(gpumon_tokens_total{{{RUN}}}[{RATE}]))"), unit="short"),
        stat("MFU", "Mean model FLOPs utilisation of the ranks' latest steps (30–55 % is good).",
             Target(f"avg(gpumon_step_mfu_ratio{{{RUN}}})"), unit="percentunit", max=1,
             thresholds=[(None, "red"), (0.2, "orange"), (0.35, "green")]),
        stat("Data-loader wait", "Share of step time waiting for the next batch "
             "(input bound from 20 %).",
             Target(f'sum(rate(gpumon_step_phase_seconds_total{{{RUN},phase="data"}}[{RATE}]))'
                    f"\n  / sum(rate(gpumon_step_duration_seconds_sum{{{RUN}}}[{RATE}]))"),
             unit="percentunit", max=1,
             thresholds=[(None, "green"), (0.05, "orange"), (0.2, "red")]),
        stat("Max OOM risk", "Highest out-of-memory risk over the selected ranks (high from 0.8).",
             Target(f"max(gpumon_oom_risk_ratio{{{RUN}}})"), unit="percentunit", max=1,
             thresholds=[(None, "green"), (0.5, "orange"), (0.8, "red")]),
        *_rank_state_panels(),
        table("Whose ranks", "Each rank's node, pod and namespace or Slurm job and step, user and "
              "pid, as the agent verified them (its process's cgroup and uid, kubelet's names).",
              Target(f"gpumon_rank_info{{{RUN}}}"), width=24),
        *_goodput_panels(),
        row("Speed"),
        timeseries("Step time p50 / p95", "Quantiles of the step-duration histogram over the "
                   "selected ranks.",
                   Target(f"histogram_quantile(0.5, {q})", "p50"),
                   Target(f"histogram_quantile(0.95, {q})", "p95"), unit="s"),
        timeseries("Throughput", "Samples and tokens per second over the selected ranks.",
                   Target(f"sum(rate(gpumon_samples_total{{{RUN}}}[{RATE}]))", "samples/s"),
                   Target(f"sum(rate(gpumon_tokens_total{{{RUN}}}[{RATE}]))", "tokens/s"),
                   options={"legend": {"displayMode": "table", "placement": "bottom",
                                       "showLegend": True, "calcs": ["lastNotNull", "mean"]}}),
        timeseries("MFU per rank", "Model FLOPs utilisation of each rank's latest step: step "
                   "FLOPs over duration × the device's peak dense FLOP/s.",
                   Target(f"gpumon_step_mfu_ratio{{{RUN}}}", "rank {{rank}}"),
                   unit="percentunit", max=1, thresholds=[(None, "red"), (0.35, "green")]),
        Panel("status-history", "Step time per rank (heatmap)",
              "Mean step time of each rank: in synchronous data parallelism every rank should "
              "match; a lasting difference points at a rank or node.",
              [Target(f"rate(gpumon_step_duration_seconds_sum{{{RUN}}}[{RATE}])"
                      f"\n  / rate(gpumon_step_duration_seconds_count{{{RUN}}}[{RATE}])",
                      "rank {{rank}}")], unit="s"),
        Panel("heatmap", "Step time distribution",
              "Steps per duration bucket over time, all selected ranks.",
              [Target(f"sum by (le) (increase(gpumon_step_duration_seconds_bucket{{{RUN}}}[{RATE}]))",
                      "{{le}}", format="heatmap")], unit="s", width=24),
        row("Where the time goes"),
        timeseries("Bottleneck mix", "Share of analysed steps per verdict (input, host, "
                   "communication, memory_bandwidth, compute, unknown).",
                   Target(f"sum by (bottleneck) (rate(gpumon_step_bottleneck_total{{{RUN}}}[{RATE}]))",
                          "{{bottleneck}}"), stack="percent", unit="short"),
        table("Current verdict per rank", "The latest verdict of each rank, with its confidence.",
              Target(f"max by (rank, bottleneck) (gpumon_step_bottleneck_current{{{RUN}}} == 1)"),
              Target(f"max by (rank) (gpumon_step_bottleneck_confidence{{{RUN}}})")),
        timeseries("Phase breakdown", "Mean seconds per step in each phase, over the selected "
                   "ranks as the loop timed them; data is the wait for the next batch. A wait on "
                   "collectives measured by watch() sits inside backward here (see Communication "
                   "overlap per rank).",
                   Target(f"sum by (phase) (rate(gpumon_step_phase_seconds_total{{{RUN}}}[{RATE}]))"
                          f"\n  / ignoring (phase) group_left"
                          f"\n  sum(rate(gpumon_steps_total{{{RUN}}}[{RATE}]))", "{{phase}}"),
                   unit="s", stack="normal"),
        timeseries("Data-loader wait share", "Share of each rank's step time waiting for data; "
                   "input bound from 20 % (GpumonInputBound).",
                   Target(_share("data"), "rank {{rank}}"), unit="percentunit", max=1,
                   thresholds=[(None, "green"), (0.2, "red")]),
        timeseries("Exposed communication share", "Share of each rank's step time blocked on "
                   "collectives, not overlapped with compute (measured by watch(), or a "
                   "hand-timed comm phase); bound from 15 % (GpumonCommunicationBound).",
                   Target(f"sum by (rank) (rate(gpumon_comm_exposed_seconds_total{{{RUN}}}[{RATE}]))"
                          f"\n  / sum by (rank) (rate(gpumon_step_duration_seconds_sum{{{RUN}}}[{RATE}]))",
                          "rank {{rank}}"), unit="percentunit", max=1,
                   thresholds=[(None, "green"), (0.15, "red")]),
        *_communication_panels(),
        *_parallelism_panels(),
        *_moe_panels(),
        row("Memory"),
        timeseries("GPU memory vs capacity", "Per rank: PyTorch allocated, reserved and per-step "
                   "peak, the whole GPU's use (NVML) and its capacity.",
                   Target(f"gpumon_torch_memory_allocated_bytes{{{RUN}}}", "rank {{rank}} allocated"),
                   Target(f"gpumon_torch_memory_reserved_bytes{{{RUN}}}", "rank {{rank}} reserved"),
                   Target(f"gpumon_torch_memory_peak_bytes{{{RUN}}}", "rank {{rank}} peak"),
                   Target(f"run_rank:gpumon_gpu_memory_used_bytes{{{RUN}}}",
                          "rank {{rank}} GPU {{gpu}} used"),
                   Target(f"run_rank:gpumon_gpu_memory_total_bytes{{{RUN}}}",
                          "rank {{rank}} GPU {{gpu}} capacity"), unit="bytes"),
        timeseries("OOM prediction", "Seconds until the per-step peak reaches capacity at its "
                   "current trend (absent while not growing); under 30 min with little headroom "
                   "fires GpumonOOMPredicted.",
                   Target(f"gpumon_oom_predicted_seconds{{{RUN}}}", "rank {{rank}}"), unit="s",
                   thresholds=[(None, "red"), (1800, "green")]),
        timeseries("OOM risk", "Composite out-of-memory risk per rank (high from 0.8).",
                   Target(f"gpumon_oom_risk_ratio{{{RUN}}}", "rank {{rank}}"),
                   unit="percentunit", max=1, thresholds=[(None, "green"), (0.8, "red")]),
        timeseries("Memory headroom", "Capacity left on each rank's GPU: capacity - max(NVML "
                   "used, torch reserved).",
                   Target(f"gpumon_oom_headroom_bytes{{{RUN}}}", "rank {{rank}}"), unit="bytes"),
        timeseries("Allocator retries and OOMs", "PyTorch allocator retries (cache flushed to "
                   "fit) and out-of-memory errors per interval.",
                   Target(f"sum by (rank) (increase(gpumon_torch_alloc_retries_total{{{RUN}}}[{RATE}]))",
                          "rank {{rank}} retries"),
                   Target(f"sum by (rank) (increase(gpumon_torch_ooms_total{{{RUN}}}[{RATE}]))",
                          "rank {{rank}} OOMs"), width=24),
        *_memory_breakdown_panels(),
        row("Training processes"),
        timeseries("Process CPU", "CPU cores used by each rank's process (data loading and "
                   "kernel launches run here).",
                   Target(f"rate(gpumon_process_cpu_seconds_total{{{RUN}}}[{RATE}])",
                          "rank {{rank}}"), unit="short"),
        timeseries("Process resident memory", "Host memory of each rank's process.",
                   Target(f"gpumon_process_resident_memory_bytes{{{RUN}}}", "rank {{rank}}"),
                   unit="bytes"),
    ]
    return dashboard(
        "gpumon-training", "gpumon / Training run",
        "One training run as gpumon sees it: step time, throughput, MFU, per-step verdicts, "
        "where the time goes, each rank's place in a model-parallel job and its pipeline's "
        "slowest stage, memory and OOM prediction.",
        [*_owner_variables(),
         query_variable("run", "Run", f"label_values(gpumon_rank_info{{{OWNERS}}}, run)"),
         query_variable("rank", "Rank", 'label_values(gpumon_steps_total{run=~"$run"}, rank)',
                        multi=True)],
        panels)


def _memory_breakdown_panels() -> list[Panel]:
    """What each rank's memory is made of, what ZeRO would make of it, and what to do."""
    capacity = {"matcher": {"id": "byFrameRefID", "options": "B"},
                "properties": [{"id": "custom.stacking", "value": {"mode": "none"}},
                               {"id": "custom.fillOpacity", "value": 0},
                               {"id": "custom.lineStyle", "value": {"fill": "dash",
                                                                    "dash": [10, 10]}},
                               {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]}
    return [
        row("Memory breakdown"),
        timeseries("Memory by component", "The rank's sampled memory, stacked: parameters, "
                   "gradients, optimizer states (fp32 master copies included), activations "
                   "(saved for backward) and other (what the allocator holds beyond them), "
                   "against its GPU's capacity. Needs mon.watch(model, optimizer).",
                   Target(f"sum by (component) (gpumon_memory_bytes{{{RUN}}})", "{{component}}"),
                   Target(f"max(run_rank:gpumon_gpu_memory_total_bytes{{{RUN}}})", "capacity"),
                   unit="bytes", stack="normal", overrides=[capacity], repeat="rank"),
        table("Framework and ZeRO stage", "What drives each rank's loop, where watch() found "
              "it (a DeepSpeed engine), and the ZeRO stage it runs: the projection below starts "
              "from that stage.",
              Target(f"max by (rank, framework, zero_stage) (gpumon_rank_framework_info{{{RUN}}})")),
        table("ZeRO projection", "Per-GPU bytes of each rank's measured memory under ZeRO "
              "stage 1 (optimizer states sharded), 2 (and gradients) and 3 (and parameters) "
              "over the run's GPUs and 2x and 4x as many, from the stage the run uses on; "
              "activations and other stay per GPU.",
              Target(f"max by (rank, stage, gpus) (gpumon_memory_zero_projected_bytes{{{RUN}}})"),
              unit="bytes"),
        table("What fills the memory", "The component an out-of-memory warning names for each "
              "rank (the one that grew, one that appeared, else the largest) and what shrinks "
              "it.",
              Target(f"max by (rank, component, cause, remedy) "
                     f"(gpumon_oom_component_bytes{{{RUN}}})"), unit="bytes"),
    ]


# --- Node / GPU -----------------------------------------------------------------------------

GPUS = 'instance=~"$instance",gpu=~"$gpu"'
NODE = 'instance=~"$instance"'


def _gpu_ratio(title: str, metric: str, description: str) -> Panel:
    return timeseries(title, description, Target(f"{metric}{{{GPUS}}}", "GPU {{gpu}}"),
                      unit="percentunit", max=1)


def node() -> dict[str, Any]:
    """One node: its GPUs' activity, memory, links, power and errors, the host and the agent."""
    panels = [
        row("Overview"),
        stat("GPUs up", "GPUs answering NVML (a lost GPU counts 0).",
             Target(f"sum(gpumon_gpu_up{{{GPUS}}})")),
        stat("NVML", "1 when the agent can use NVML (or its simulator).",
             Target(f"min(gpumon_nvml_up{{{NODE}}})"),
             thresholds=[(None, "red"), (1, "green")]),
        stat("XID errors", "XID errors reported in the dashboard's time range.",
             Target(f"sum(increase(gpumon_gpu_xid_errors_total{{{GPUS}}}[$__range])) or vector(0)"),
             thresholds=[(None, "green"), (1, "red")]),
        stat("Uncorrected ECC", "Uncorrected ECC errors in the dashboard's time range.",
             Target(f'sum(increase(gpumon_gpu_ecc_errors_total{{{GPUS},type="uncorrected"}}[$__range]))'
                    " or vector(0)"),
             thresholds=[(None, "green"), (1, "red")]),
        stat("Host CPU", "Share of the node's CPU time in use.",
             Target(f"max(gpumon_host_cpu_utilization_ratio{{{NODE}}})"), unit="percentunit",
             max=1, thresholds=[(None, "green"), (0.9, "red")]),
        stat("Agent version", "Version of the gpumon agent.",
             Target(f"max by (version) (gpumon_agent_info{{{NODE}}})", "{{version}}"),
             options={"textMode": "name"}),
        row("Activity"),
        _gpu_ratio("GPU utilisation", "gpumon_gpu_utilization_ratio",
                   "Share of time a kernel was running (not how much of the GPU it used)."),
        _gpu_ratio("SM active", "gpumon_gpu_sm_active_ratio",
                   "Share of SMs busy (GPM, Hopper and newer): how much of the GPU kernels use."),
        _gpu_ratio("Tensor-core active", "gpumon_gpu_tensor_active_ratio",
                   "Share of time the SMs ran tensor-core instructions (GPM)."),
        _gpu_ratio("DRAM bandwidth active", "gpumon_gpu_dram_active_ratio",
                   "Device-memory bandwidth used over its peak (GPM): high with little tensor "
                   "activity means memory-bandwidth bound."),
        _gpu_ratio("SM occupancy", "gpumon_gpu_sm_occupancy_ratio",
                   "Resident warps over the theoretical maximum (GPM)."),
        _gpu_ratio("Memory-controller busy", "gpumon_gpu_memory_utilization_ratio",
                   "Share of time device memory was read or written (NVML)."),
        row("Memory"),
        timeseries("GPU memory used vs total", "Device memory in use and in total per GPU.",
                   Target(f"gpumon_gpu_memory_used_bytes{{{GPUS}}}", "GPU {{gpu}} used"),
                   Target(f"gpumon_gpu_memory_total_bytes{{{GPUS}}}", "GPU {{gpu}} total"),
                   unit="bytes"),
        table("GPU memory by process", "Device memory held by each compute process.",
              Target(f"gpumon_gpu_process_memory_bytes{{{GPUS}}}"), unit="bytes"),
        table("Whose GPUs", "Each GPU's holders: the process (or the container the kubelet "
              "allocated the GPU to), its pod, namespace or Slurm job, user, and the run and rank "
              "it reports, as the agent verified them.",
              Target(f"gpumon_gpu_owner_info{{{GPUS}}}")),
        row("Interconnect"),
        timeseries("NVLink throughput", "Bytes per second over all NVLink links, per GPU.",
                   Target(f"rate(gpumon_gpu_nvlink_transmit_bytes_total{{{GPUS}}}[{RATE}])",
                          "GPU {{gpu}} tx"),
                   Target(f"rate(gpumon_gpu_nvlink_receive_bytes_total{{{GPUS}}}[{RATE}])",
                          "GPU {{gpu}} rx"), unit="Bps"),
        timeseries("PCIe throughput", "Bytes per second over PCIe, per GPU.",
                   Target(f"rate(gpumon_gpu_pcie_transmit_bytes_total{{{GPUS}}}[{RATE}])",
                          "GPU {{gpu}} tx"),
                   Target(f"rate(gpumon_gpu_pcie_receive_bytes_total{{{GPUS}}}[{RATE}])",
                          "GPU {{gpu}} rx"), unit="Bps"),
        row("Power, temperature, clocks"),
        timeseries("Power", "Power draw per GPU.",
                   Target(f"gpumon_gpu_power_watts{{{GPUS}}}", "GPU {{gpu}}"), unit="watt", width=8),
        timeseries("Temperature", "GPU core temperature.",
                   Target(f"gpumon_gpu_temperature_celsius{{{GPUS}}}", "GPU {{gpu}}"),
                   unit="celsius", width=8, min=None),
        timeseries("SM clock", "Current SM clock; drops under load point at throttling.",
                   Target(f"gpumon_gpu_sm_clock_hertz{{{GPUS}}}", "GPU {{gpu}}"), unit="hertz",
                   width=8),
        Panel("status-history", "Clock events (throttle reasons)",
              "1 while a clock-event reason is active: thermal and HW slowdowns cost speed "
              "(GpumonThermalThrottling); sw_power_cap is normal on a busy GPU.",
              [Target(f"max by (gpu, reason) (gpumon_gpu_clock_event_active{{{GPUS}}})",
                      "GPU {{gpu}} {{reason}}")], width=24, height=10, max=1,
              thresholds=[(None, "green"), (1, "red")]),
        row("Errors"),
        table("XID errors by GPU", "XID errors per GPU and code in the dashboard's time range; see "
              "GpumonXidError's runbook for which need a reset.",
              Target(f"sum by (gpu, uuid, xid) (increase(gpumon_gpu_xid_errors_total{{{GPUS}}}[$__range]))")),
        timeseries("ECC errors", "ECC errors per interval, per GPU and type.",
                   Target(f"sum by (gpu, type) (increase(gpumon_gpu_ecc_errors_total{{{GPUS}}}[{RATE}]))",
                          "GPU {{gpu}} {{type}}")),
        row("Host and agent"),
        timeseries("Host CPU and memory", "Share of the node's CPU time and memory in use.",
                   Target(f"gpumon_host_cpu_utilization_ratio{{{NODE}}}", "CPU"),
                   Target(f"gpumon_host_memory_used_bytes{{{NODE}}}"
                          f" / gpumon_host_memory_total_bytes{{{NODE}}}",
                          "memory"), unit="percentunit", max=1),
        timeseries("Collector cycle duration", "Duration of each collector's last cycle; "
                   "collection runs apart from scrapes.",
                   Target(f"gpumon_collector_duration_seconds{{{NODE}}}", "{{collector}}"), unit="s"),
        timeseries("Ingest", "Step records accepted and dropped per second, by kind and reason "
                   "(GpumonIngestDropping).",
                   Target(f"sum by (kind) (rate(gpumon_ingest_records_total{{{NODE}}}[{RATE}]))",
                          "accepted {{kind}}"),
                   Target(f"sum by (reason) (rate(gpumon_ingest_dropped_total{{{NODE}}}[{RATE}]))",
                          "dropped {{reason}}")),
        timeseries("Agent CPU and memory", "The agent's own cost: CPU cores and resident memory.",
                   Target(f"rate(gpumon_agent_process_cpu_seconds_total{{{NODE}}}[{RATE}])", "CPU cores"),
                   Target(f"gpumon_agent_process_resident_memory_bytes{{{NODE}}} / 2^30", "RSS GiB")),
    ]
    return dashboard(
        "gpumon-node", "gpumon / Node and GPUs",
        "One node: GPU activity (SM, tensor, DRAM), memory, NVLink/PCIe, power, temperature, "
        "clocks and throttling, XID/ECC errors, the host and the gpumon agent.",
        [query_variable("instance", "Node", "label_values(gpumon_agent_info, instance)"),
         query_variable("gpu", "GPU", 'label_values(gpumon_gpu_info{instance=~"$instance"}, gpu)',
                        multi=True)],
        panels)


# --- Fleet ----------------------------------------------------------------------------------

JOB = 'job=~"$job"'


def fleet() -> dict[str, Any]:
    """Every node: how many GPUs hit which wall, which sit idle or near OOM, what fires."""
    panels = [
        row("Overview"),
        stat("Nodes", "Agents scraped.", Target(f"count(gpumon_agent_info{{{JOB}}})")),
        stat("Agents down", "Agent targets Prometheus cannot scrape (GpumonAgentDown).",
             Target(f"count(up{{{JOB}}} == 0) or vector(0)"),
             thresholds=[(None, "green"), (1, "red")]),
        stat("GPUs", "GPUs known to the agents.", Target(f"count(gpumon_gpu_up{{{JOB}}})")),
        stat("GPUs lost", "GPUs that stopped answering NVML (GpumonGpuLost).",
             Target(f"count(gpumon_gpu_up{{{JOB}}} == 0) or vector(0)"),
             thresholds=[(None, "green"), (1, "red")]),
        stat("Idle GPUs", "GPUs under 10 % utilisation.",
             Target(f"count(gpumon_gpu_utilization_ratio{{{JOB}}} < 0.1) or vector(0)"),
             thresholds=[(None, "green"), (1, "orange")]),
        stat("Firing alerts", "gpumon alerts firing now.",
             Target('count(ALERTS{alertname=~"Gpumon.*",alertstate="firing"}) or vector(0)'),
             thresholds=[(None, "green"), (1, "red")]),
        row("Bottlenecks"),
        timeseries("GPUs by bottleneck", "Ranks (one per GPU) by their current verdict.",
                   Target(f"count by (bottleneck) (gpumon_step_bottleneck_current{{{JOB}}} == 1)",
                          "{{bottleneck}}"), stack="normal"),
        timeseries("Bottleneck mix by run", "Share of each run's steps per verdict.",
                   Target("run_bottleneck:gpumon_step_bottleneck:ratio_rate5m",
                          "{{run}} {{bottleneck}}"), unit="percentunit", max=1),
        row("Runs"),
        timeseries("Tokens / s by run", "Tokens per second of each run over all its ranks.",
                   Target("run:gpumon_tokens:rate5m", "{{run}}")),
        timeseries("Mean step time by run", "Mean step time of each run over all its ranks.",
                   Target("run:gpumon_step_duration_seconds:mean5m", "{{run}}"), unit="s"),
        timeseries("MFU by run", "Mean model FLOPs utilisation of each run's ranks.",
                   Target(f"avg by (run) (gpumon_step_mfu_ratio{{{JOB}}})", "{{run}}"),
                   unit="percentunit", max=1, thresholds=[(None, "red"), (0.2, "green")]),
        timeseries("Input and communication share by run", "Share of step time waiting for "
                   "data and blocked on collectives, over each run's ranks.",
                   Target(f"sum by (run) (rate(gpumon_step_phase_seconds_total"
                          f'{{{JOB},phase="data"}}[{RATE}]))'
                          f"\n  / sum by (run) (rate(gpumon_step_duration_seconds_sum{{{JOB}}}[{RATE}]))",
                          "{{run}} input"),
                   Target(f"sum by (run) (rate(gpumon_comm_exposed_seconds_total{{{JOB}}}[{RATE}]))"
                          f"\n  / sum by (run) (rate(gpumon_step_duration_seconds_sum{{{JOB}}}[{RATE}]))",
                          "{{run}} communication"), unit="percentunit", max=1),
        row("Idle GPUs and memory pressure"),
        table("Least busy GPUs", "The ten GPUs with the lowest mean utilisation over the time "
              "range; red under 10 %.",
              Target(f"bottomk(10, avg_over_time(gpumon_gpu_utilization_ratio{{{JOB}}}[$__range]))"),
              unit="percentunit", max=1,
              thresholds=[(None, "red"), (0.1, "orange"), (0.5, "green")]),
        table("Ranks by OOM risk", "The ten ranks closest to running out of memory.",
              Target(f"topk(10, gpumon_oom_risk_ratio{{{JOB}}})"), unit="percentunit", max=1,
              thresholds=[(None, "green"), (0.5, "orange"), (0.8, "red")]),
        table("GPUs by memory used", "The ten fullest GPUs (share of device memory in use).",
              Target(f"topk(10, gpumon_gpu_memory_used_bytes{{{JOB}}}"
                     f" / gpumon_gpu_memory_total_bytes{{{JOB}}})"),
              unit="percentunit", max=1,
              thresholds=[(None, "green"), (0.75, "orange"), (0.9, "red")]),
        row("Alerts"),
        table("gpumon alerts", "Firing and pending gpumon alerts (pending: the condition holds "
              "but not yet for the rule's `for:`).",
              Target('ALERTS{alertname=~"Gpumon.*"}'), width=24, min=None),
    ]
    return dashboard(
        "gpumon-fleet", "gpumon / Fleet",
        "All nodes and runs: GPUs by bottleneck, idle GPUs, memory pressure and firing alerts.",
        # All = the agents' jobs, not `.*`: `up{job=~"$job"}` must not count other targets.
        [query_variable("job", "Job", "label_values(gpumon_agent_info, job)", multi=True,
                        all_value=None)],
        panels)


DASHBOARDS = {"gpumon-training.json": training, "gpumon-node.json": node,
              "gpumon-fleet.json": fleet}


def render(build: Any) -> str:
    """The dashboard's JSON text, as checked in."""
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    """Write every dashboard next to this script."""
    for name, build in DASHBOARDS.items():
        (HERE / name).write_text(render(build))
        print(f"wrote dashboards/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
