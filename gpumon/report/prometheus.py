"""A run from a Prometheus-compatible server (Prometheus, VictoriaMetrics): range queries of the
agent's own series (docs/metrics.md), one step of the query per time bin of the model.

Only the HTTP API's ``query`` and ``query_range`` are used, which both servers answer alike.
Every request has a timeout; a server that does not answer in time is named in the error.
"""

from __future__ import annotations

import json
import math
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gpumon.analysis.goodput import CAUSES, TimeTotals
from gpumon.report.model import (
    GPU_METRICS,
    LINK_METRICS,
    MAX_BINS,
    MEMORY_COMPONENTS,
    Mean,
    Peak,
    ReportError,
    RunModel,
)
from gpumon.wire import PARALLEL_DIMS, ParallelLayout

VERDICTS_TOTAL = "gpumon_step_bottleneck_total"
"""Steps per verdict: the counter, whose name stays while the current-verdict gauge's changes."""
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_GPU_SERIES = {"utilization": "gpumon_gpu_utilization_ratio",
               "sm_active": "gpumon_gpu_sm_active_ratio",
               "tensor_active": "gpumon_gpu_tensor_active_ratio",
               "dram_active": "gpumon_gpu_dram_active_ratio"}
_LINK_COUNTERS = {"nvlink_tx_bytes_per_second": "gpumon_gpu_nvlink_transmit_bytes_total",
                  "nvlink_rx_bytes_per_second": "gpumon_gpu_nvlink_receive_bytes_total",
                  "pcie_tx_bytes_per_second": "gpumon_gpu_pcie_transmit_bytes_total",
                  "pcie_rx_bytes_per_second": "gpumon_gpu_pcie_receive_bytes_total"}
assert set(_GPU_SERIES) == {k for k, _ in GPU_METRICS}
assert set(_LINK_COUNTERS) == {k for k, _ in LINK_METRICS}


def parse_duration(text: str) -> float:
    """``30m``, ``6h``, ``2d`` → seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise ReportError(f"--since {text!r}: give a duration such as 30m, 6h or 2d")
    return float(match.group(1)) * _UNITS[match.group(2)]


class PrometheusSource:
    """The server's HTTP API, each request bounded by ``timeout_s``."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: dict[str, str]) -> Any:
        address = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(address, timeout=self.timeout_s) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace")
            raise ReportError(f"{self.url} refused the query {params.get('query')!r}: "
                              f"HTTP {exc.code} {detail}") from exc
        except TimeoutError as exc:
            raise ReportError(f"{self.url} did not answer within {self.timeout_s:g} s") from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError | socket.timeout):
                raise ReportError(f"{self.url} did not answer within {self.timeout_s:g} s"
                                  ) from exc
            raise ReportError(f"cannot reach {self.url}: {exc.reason}") from exc
        except (OSError, ValueError) as exc:
            raise ReportError(f"{self.url} gave no usable answer: {exc}") from exc
        if not isinstance(body, dict) or body.get("status") != "success":
            raise ReportError(f"{self.url} answered the query {params.get('query')!r} with "
                              f"{str(body)[:300]}")
        return body["data"]["result"]

    def instant(self, query: str) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/query", {"query": query}))

    def range(self, query: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/query_range", {
            "query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}))

    def runs(self, since: str) -> list[str]:
        """The runs with steps in the last ``since``."""
        found = self.instant(f"group by (run) (last_over_time(gpumon_steps_total[{since}]))")
        return sorted(r["metric"].get("run", "") for r in found)


def _points(series: dict[str, Any]) -> list[tuple[float, float]]:
    out = []
    for t, v in series.get("values", []):
        value = float(v)
        if math.isfinite(value):
            out.append((float(t), value))
    return out


def restart_moments(points: list[tuple[float, float]]) -> list[float]:
    """The times of a restart counter's range points where it went up, once per restart it
    counted there; a fall (an agent restarted, its counters anew) restarts the count."""
    moments: list[float] = []
    for (_, before), (t, after) in zip(points, points[1:], strict=False):
        if after > before:
            moments += [t] * round(after - before)
    return moments


def load_prometheus(url: str, run: str, since: str, timeout_s: float) -> RunModel:
    """The model of ``run`` over the last ``since``, from the server at ``url``."""
    source = PrometheusSource(url, timeout_s)
    span = parse_duration(since)
    runs = source.runs(since)
    if run not in runs:
        listed = ", ".join(repr(r) for r in runs) or "none"
        raise ReportError(f"no run {run!r} in {url} over the last {since}; "
                          f"the runs there are: {listed}")
    sel = f'run="{_escape(run)}"'
    now = time.time()
    step = max(1.0, math.ceil(span / MAX_BINS))
    counts = source.range(f"sum(gpumon_steps_total{{{sel}}})", now - span, now, step)
    times = [t for t, _ in _points(counts[0])] if counts else []
    if len(times) < 2:
        raise ReportError(f"run {run!r} has fewer than two samples in {url} over the last "
                          f"{since}: nothing to draw over time")
    start, end = times[0], times[-1]
    model = RunModel(run=run, source=f"{url} (last {since})", start=start, end=end,
                     bins=max(1, min(MAX_BINS, round((end - start) / step) + 1)))
    model.width_s = step
    model.start = start - step / 2
    query = _Query(source, model, start, end, step, sel)
    window = f"{max(4 * int(step), 60)}s"
    query.fill(model, window, since)
    return model


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


class _Query:
    """Range queries of one run, each answer put into the model's bins."""

    def __init__(self, source: PrometheusSource, model: RunModel, start: float, end: float,
                 step: float, sel: str) -> None:
        self.source, self.model = source, model
        self.start, self.end, self.step, self.sel = start, end, step, sel

    def series(self, query: str) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        return [(r["metric"], _points(r)) for r in
                self.source.range(query, self.start, self.end, self.step)]

    def by(self, query: str, label: str, into: dict[Any, Mean], as_int: bool = False) -> None:
        for labels, points in self.series(query):
            key: Any = labels.get(label, "")
            if as_int:
                key = int(key) if key.lstrip("-").isdigit() else key
            mean = self.model.mean(into, key)
            for t, v in points:
                mean.add(self.model.index(t), v)

    def fill(self, model: RunModel, window: str, since: str) -> None:
        sel = self.sel
        per_step = f"sum by (rank) (rate(gpumon_steps_total{{{sel}}}[{window}]))"
        self.by(f"sum by (rank) (rate(gpumon_step_duration_seconds_sum{{{sel}}}[{window}])) / "
                f"sum by (rank) (rate(gpumon_step_duration_seconds_count{{{sel}}}[{window}]))",
                "rank", model.step_time, as_int=True)
        model.ranks = sorted(k for k in model.step_time if isinstance(k, int))
        phases: dict[str, Mean] = {}
        self.by(f"sum by (rank, phase) (rate(gpumon_step_phase_seconds_total{{{sel}}}[{window}]))"
                f" / on (rank) group_left {per_step}", "phase", phases)
        # Every rank's series into one mean (keyed "": no label splits them).
        exposed: dict[str, Mean] = {}
        self.by(f"sum by (rank) (rate(gpumon_comm_exposed_seconds_total{{{sel}}}[{window}])) / "
                f"{per_step}", "", exposed)
        overlapped: dict[str, Mean] = {}
        self.by(f"sum by (rank) (rate(gpumon_comm_overlapped_seconds_total{{{sel}}}[{window}]))"
                f" / {per_step}", "", overlapped)
        self._phases(phases, exposed.get(""), overlapped.get(""))
        self.by(f"avg by (op) (gpumon_collective_bus_bandwidth_bytes_per_second{{{sel}}})", "op",
                model.bus_bandwidth)
        for labels, points in self.series(
                f"sum by (rank, bottleneck) (increase({VERDICTS_TOTAL}{{{sel}}}[{window}]))"):
            strip = model.rank_verdicts(int(labels.get("rank", "0")))
            for t, v in points:
                if v > 0:
                    strip[model.index(t)][labels.get("bottleneck", "unknown")] += round(v)
        self.by(f'sum by (rank) (rate(gpumon_collective_seconds_total{{{sel},op="all_to_all"}}[{window}]))'
                f" / {per_step}", "rank", model.all_to_all, as_int=True)
        for labels, points in self.series(f"max by (layer) (gpumon_moe_expert_load_max_ratio{{{sel}}})"):
            peak = model.peak(model.moe_ratio, labels.get("layer", ""))
            for t, v in points:
                peak.add(model.index(t), v)
        self._memory()
        self._gpus(window)
        self._parallel(window, since)
        self._times(since)
        self._summary(since)

    def _phases(self, phases: dict[str, Mean], exposed: Mean | None,
                overlapped: Mean | None) -> None:
        model = self.model
        wait = exposed.values() if exposed is not None else [None] * model.bins
        for name, mean in phases.items():
            if name == "backward" and "comm" not in phases:  # the wait is inside backward
                mean.sums = [s - (w or 0.0) * c if c else s
                             for s, c, w in zip(mean.sums, mean.counts, wait, strict=True)]
            model.phases[name] = mean
        if exposed is not None and "comm" not in phases:
            model.phases["comm"] = exposed
        if exposed is not None:
            model.comm_exposed = exposed
            model.comm_overlapped = overlapped or Mean(model.bins)
        steps = Mean(model.bins)
        for mean in model.step_time.values():
            for i, (s, c) in enumerate(zip(mean.sums, mean.counts, strict=True)):
                if c:
                    steps.add(i, s / c)
        known = [sum(m.values()[i] or 0.0 for m in model.phases.values())
                 for i in range(model.bins)]
        other = model.mean(model.phases, "other")
        for i, value in enumerate(steps.values()):
            if value is not None:
                other.add(i, max(0.0, value - known[i]))

    def _memory(self) -> None:
        model, sel = self.model, self.sel
        for labels, points in self.series(f"max by (rank) (gpumon_torch_memory_peak_bytes{{{sel}}})"):
            peak = model.memory_peak.setdefault(int(labels.get("rank", "0")), Peak(model.bins))
            for t, v in points:
                peak.add(model.index(t), v)
        highest = {r: max((v for v in p.peaks if v is not None), default=0.0)
                   for r, p in model.memory_peak.items()}
        if highest:
            model.memory_rank = max(highest, key=lambda r: highest[r])
            self.by(f'max by (component) (gpumon_memory_bytes{{{sel},rank="{model.memory_rank}"}})',
                    "component", model.memory_components)
            for name in list(model.memory_components):
                if name not in MEMORY_COMPONENTS:
                    del model.memory_components[name]
        capacity = self.source.instant(
            f"min(gpumon_gpu_memory_total_bytes and on (instance) group by (instance) "
            f"(gpumon_steps_total{{{sel}}}))")
        if capacity:
            model.capacity_bytes = float(capacity[0]["value"][1])

    def _gpus(self, window: str) -> None:
        on_node = f"and on (instance) group by (instance) (gpumon_steps_total{{{self.sel}}})"
        for key, name in _GPU_SERIES.items():
            self.by(f"({name} {on_node})", "gpu", self.model.gpu[key], as_int=True)
        for key, name in _LINK_COUNTERS.items():
            self.by(f"(rate({name}[{window}]) {on_node})", "gpu", self.model.gpu[key],
                    as_int=True)
        for key in list(self.model.gpu):
            if not self.model.gpu[key]:
                del self.model.gpu[key]

    def _per_rank(self, query: str) -> dict[int, float]:
        out: dict[int, float] = {}
        for r in self.source.instant(query):
            value = float(r["value"][1])
            if math.isfinite(value):
                out[int(r["metric"].get("rank", "0"))] = value
        return dict(sorted(out.items()))

    def _parallel(self, window: str, since: str) -> None:
        """Each rank's layout, own work per step and bubble, for a run whose ranks report a
        layout or receive from one another (an empty label is a dimension the job lacks)."""
        model, sel = self.model, self.sel
        for r in self.source.instant(f"max by (rank, {', '.join(PARALLEL_DIMS)}) (last_over_time("
                                     f"gpumon_rank_parallel_info{{{sel}}}[{since}]))"):
            labels = r["metric"]
            index = {dim: int(labels[dim]) for dim in PARALLEL_DIMS
                     if labels.get(dim, "").isdigit()}
            model.layouts[int(labels.get("rank", "0"))] = ParallelLayout(
                dp=index.get("dp"), tp=index.get("tp"), pp=index.get("pp"), ep=index.get("ep"),
                cp=index.get("cp"))
        model.layouts = dict(sorted(model.layouts.items()))
        step_s = f"sum by (rank) (increase(gpumon_step_duration_seconds_sum{{{sel}}}[{since}]))"
        model.bubble_share = self._per_rank(
            f"sum by (rank) (increase(gpumon_pipeline_bubble_seconds_total{{{sel}}}[{since}]))"
            f" / {step_s}")
        if not model.layouts and not model.bubble_share:
            return
        exposed = f"sum by (rank) (increase(gpumon_comm_exposed_seconds_total{{{sel}}}[{since}]))"
        model.own_work_s = self._per_rank(
            f"clamp_min({step_s} - ({exposed} or 0 * {step_s}), 0)"
            f" / sum by (rank) (increase(gpumon_steps_total{{{sel}}}[{since}]))")
        self.by(f"sum by (rank) (rate(gpumon_pipeline_bubble_seconds_total{{{sel}}}[{window}])) / "
                f"sum by (rank) (rate(gpumon_step_duration_seconds_sum{{{sel}}}[{window}]))",
                "rank", model.bubble, as_int=True)

    def _times(self, since: str) -> None:
        """Where each rank's time went: its counters' last values over the range, summed over
        the agents that counted it (a rank continued on another node), and its restarts at
        the range points where its restart counter went up (within a point's step)."""
        sel, last = self.sel, f"[{since}]))"
        goodput = self._per_rank(f"sum by (rank) (last_over_time(gpumon_goodput_seconds_total"
                                 f"{{{sel}}}{last}")
        if not goodput:
            return
        badput: dict[int, dict[str, float]] = {}
        for r in self.source.instant(f"sum by (rank, cause) (last_over_time("
                                     f"gpumon_badput_seconds_total{{{sel}}}{last}"):
            value, cause = float(r["value"][1]), r["metric"].get("cause", "")
            if cause in CAUSES and math.isfinite(value):
                badput.setdefault(int(r["metric"].get("rank", "0")), {})[cause] = value
        unsaved = self._per_rank(f"sum by (rank) (last_over_time(gpumon_unsaved_seconds"
                                 f"{{{sel}}}{last}")
        restarts = self._per_rank(f"sum by (rank) (last_over_time(gpumon_rank_restarts_total"
                                  f"{{{sel}}}{last}")
        moments: dict[int, list[float]] = {}
        for labels, points in self.series(f"sum by (rank) (gpumon_rank_restarts_total{{{sel}}})"):
            moments[int(labels.get("rank", "0"))] = restart_moments(points)
        for rank, kept in goodput.items():
            causes = badput.get(rank, {})
            self.model.time_totals[rank] = TimeTotals(
                goodput_s=kept, badput_s={c: causes.get(c, 0.0) for c in CAUSES},
                unsaved_s=unsaved.get(rank, 0.0), restarts=round(restarts.get(rank, 0.0)),
                restarted_at=tuple(moments.get(rank, ())))

    def _summary(self, since: str) -> None:
        model, sel, summary = self.model, self.sel, self.model.summary
        seconds = model.end - model.start

        def scalar(query: str) -> float | None:
            found = self.source.instant(query)
            return float(found[0]["value"][1]) if found else None

        summary.seconds = seconds
        summary.ranks = len(model.ranks)
        summary.steps = round(scalar(f"sum(increase(gpumon_steps_total{{{sel}}}[{since}]))")
                              or 0)
        samples = scalar(f"sum(rate(gpumon_samples_total{{{sel}}}[{since}]))")
        tokens = scalar(f"sum(rate(gpumon_tokens_total{{{sel}}}[{since}]))")
        summary.samples_per_s = samples or None
        summary.tokens_per_s = tokens or None
        summary.mfu = scalar(f"avg(avg_over_time(gpumon_step_mfu_ratio{{{sel}}}[{since}]))")
        walls = {r["metric"].get("bottleneck", "unknown"): float(r["value"][1])
                 for r in self.source.instant(f"sum by (bottleneck) (increase({VERDICTS_TOTAL}"
                                              f"{{{sel}}}[{since}]))")}
        total = sum(walls.values())
        summary.walls = {k: v / total for k, v in sorted(walls.items(), key=lambda kv: -kv[1])
                         if v > 0} if total else {}
        if summary.walls:
            from gpumon.analysis.hints import WALL_HINTS

            summary.top_hint = WALL_HINTS.get(next(iter(summary.walls)))
        causes: dict[int, str] = {}
        for r in self.source.instant(f"max by (rank, cause) (max_over_time("
                                     f"gpumon_rank_straggler_cause{{{sel}}}[{since}])) == 1"):
            causes[int(r["metric"].get("rank", "0"))] = r["metric"].get("cause", "unknown")
        for r in self.source.instant(f'max by (rank) (max_over_time(gpumon_step_flag{{{sel},'
                                     f'flag="straggler"}}[{since}])) == 1'):
            rank = int(r["metric"].get("rank", "0"))
            summary.stragglers[rank] = causes.get(rank, "unknown")
        summary.stragglers = dict(sorted(summary.stragglers.items()))
        for r in self.source.instant(f"max by (rank) (max_over_time(gpumon_rank_stalled_seconds"
                                     f"{{{sel}}}[{since}])) > 0"):
            summary.stalls[int(r["metric"].get("rank", "0"))] = float(r["value"][1])
        summary.oom_events = round(scalar(f"sum(increase(gpumon_torch_ooms_total{{{sel}}}"
                                          f"[{since}]))") or 0)
        for r in self.source.instant(f"min by (rank) (last_over_time(gpumon_oom_predicted_seconds"
                                     f"{{{sel}}}[{since}]))"):
            left = float(r["value"][1])
            if math.isfinite(left) and left > 0:
                summary.oom_prediction[int(r["metric"].get("rank", "0"))] = (
                    left, f"reaches the device's memory in {left / 60:.1f} min at the trend "
                          f"of its peaks (last reading)")


__all__ = ["PrometheusSource", "load_prometheus", "parse_duration", "restart_moments"]
