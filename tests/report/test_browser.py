"""The page as a browser draws it: headless Chromium opens a report made by `gpumon report`
from a recording whose numbers are known, and the figures' data are compared with them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from gpumon.agent.recorder import time_from_line
from gpumon.testing.recordings import GIB, Run, time_figures, write
from tests.helpers import ROOT, agent_env
from tests.report.browser import open_page

FIGURES = {"time-by-cause", "step-phases", "verdicts", "step-heatmap", "memory", "gpu-activity",
           "links", "comm"}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("browser")
    recording = write(tmp / "run.jsonl", Run(times=True))
    page = tmp / "run.html"
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "report", str(recording),
                             "-o", str(page)], capture_output=True, text=True, env=agent_env(),
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "360 steps of 3 ranks" in result.stdout
    steps = [json.loads(line) for line in recording.read_text().splitlines()]
    return open_page(page, tmp), [s for s in steps if s["kind"] == "step"]


def test_the_page_loads_without_errors_and_draws_every_figure(
        drawn: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    page, _ = drawn
    assert page["errors"] == []
    assert set(page["figures"]) == set(page["meta"]["figures"]) == FIGURES
    for name, figure in page["figures"].items():
        assert figure["svg"] >= 1, name
        assert figure["drawn"] >= 1 and figure["data"], name
    assert page["figures"]["verdicts"]["heatmaps"] == 1
    assert page["figures"]["step-heatmap"]["heatmaps"] == 1


def test_the_stacked_phases_are_the_recordings_per_step_means(
        drawn: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    page, steps = drawn
    traces = {t["name"]: t for t in page["figures"]["step-phases"]["data"]}
    assert set(traces) == {"data", "forward", "backward", "optimizer", "exposed comm", "other"}
    x = traces["data"]["x"]
    start, width = page["meta"]["start"], page["meta"]["bin_s"]
    assert start == min(s["t_start"] for s in steps) and len(x) == page["meta"]["bins"]
    duration, data, wait = defaultdict(list), defaultdict(list), defaultdict(list)
    for s in steps:  # the recording's own numbers, binned by when each step ended
        i = min(len(x) - 1, int((s["t_start"] + s["duration"] - start) / width))
        duration[i].append(s["duration"])
        data[i].append(s["phases"]["data"])
        wait[i].append(s["comm"]["exposed"])
    assert len(duration) >= 0.9 * len(x)
    # The page carries 5 significant digits of each figure.
    for i, values in duration.items():
        stacked = sum(t["y"][i] or 0.0 for t in traces.values())
        assert stacked == pytest.approx(sum(values) / len(values), rel=1e-4), i
        assert traces["data"]["y"][i] == pytest.approx(sum(data[i]) / len(data[i]), rel=1e-4)
        assert traces["exposed comm"]["y"][i] == pytest.approx(sum(wait[i]) / len(wait[i]),
                                                               rel=1e-4)


def test_the_straggler_is_marked_with_its_cause(
        drawn: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    page, _ = drawn
    heatmap = page["figures"]["step-heatmap"]["data"][0]
    assert [label for label in heatmap["y"] if "straggler" in label] == [
        "rank 2 ⚠ straggler (compute)"]
    # Its peers wait for it: by the end each strip says so (communication), its own compute.
    verdicts = page["figures"]["verdicts"]["data"][0]
    last = {label: row[-1] for label, row in zip(verdicts["y"], verdicts["text"], strict=True)}
    assert last == {"rank 0": "communication", "rank 1": "communication", "rank 2": "compute"}


def test_memory_is_drawn_against_the_device(
        drawn: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    page, steps = drawn
    traces = {t["name"]: t for t in page["figures"]["memory"]["data"]}
    last_peak = max(s["mem"]["peak"] for s in steps if s["rank"] == 2) / GIB
    assert max(v for v in traces["rank 2 peak"]["y"] if v is not None) == pytest.approx(last_peak, rel=1e-4)
    # The breakdown of one rank (every peak here is the same), stacked by component.
    parts = [n.split(": ") for n in traces if ": " in n]
    assert len({rank for rank, _ in parts}) == 1
    assert [part for _, part in parts] == [
        "parameters", "gradients", "optimizer_states", "activations", "other"]


def test_each_ranks_time_is_drawn_by_cause_and_its_restart_on_the_time_axis(
        drawn: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    page, _ = drawn
    bars = {t["name"]: t for t in page["figures"]["time-by-cause"]["data"]}
    assert list(bars) == ["goodput", "unsaved", "startup", "checkpoint", "lost", "restart",
                          "other"]
    run = Run(times=True)
    for name, trace in bars.items():
        assert trace["type"] == "bar" and trace["y"] == ["rank 0", "rank 1", "rank 2"]
        want = [time_from_line(time_figures(run, rank))[3] for rank in range(run.ranks)]
        assert trace["x"] == pytest.approx([
            t.goodput_s if name == "goodput" else t.unsaved_s if name == "unsaved"
            else t.badput_s[name] for t in want], rel=1e-4)
    # Rank 1 restarted half-way through the run: marked there, on the step time's axis.
    restarted = time_figures(run, 1)["restarted_at"][0] - page["meta"]["start"]
    phases = page["figures"]["step-phases"]
    assert [s["x0"] for s in phases["shapes"]] == [pytest.approx(restarted, abs=1e-3)]
    assert [n["text"] for n in phases["notes"]] == ["↻ rank 1"]


@pytest.mark.parametrize("width", [1400, 390], ids=["desktop", "phone"])
def test_a_short_run_on_idle_gpus_says_so_and_draws_nothing_empty_or_overlapping(
        tmp_path: Path, width: int) -> None:
    """Ten seconds of two ranks on GPUs that never worked: no empty GPU or link plot (the page
    says why), a colour bar whose labels do not overlap, nothing wider than the window."""
    recording = write(tmp_path / "idle.jsonl", Run(steps=25, ranks=2, straggler=1, times=True,
                                                   gpus_active=False))
    page = tmp_path / "idle.html"
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "report", str(recording),
                             "-o", str(page)], capture_output=True, text=True, env=agent_env(),
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    drawn = open_page(page, tmp_path, width)
    assert drawn["errors"] == []
    assert set(drawn["figures"]) == FIGURES - {"gpu-activity", "links"}
    text = page.read_text()
    assert text.count("No GPU activity in this run") == 2  # in both sections, said once each
    assert "Not in this run's data" not in text
    ticks = sorted(drawn["figures"]["step-heatmap"]["ticks"])
    assert len(ticks) >= 2, ticks
    overlaps = [(a, b) for a, b in zip(ticks, ticks[1:], strict=False) if a[1] > b[0] + 0.5]
    assert not overlaps, ticks
    assert drawn["inner"] <= max(width, 500)  # (headless Chromium's narrowest window)
    assert drawn["overflow"] <= 0
    widths = {k: f["width"] for k, f in drawn["figures"].items()}
    assert all(w <= drawn["inner"] for w in widths.values()), (drawn["inner"], widths)
