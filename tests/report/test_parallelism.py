"""`gpumon report` of a run that splits its model: a pipeline of two stages of two data-parallel
replicas each (``pipeline.py``), recorded as an agent records it (each rank's hello with its
layout, steps whose communication carries the bubble). The page names each rank's place, own
work and bubble and the stage that holds the pipeline back; the replay compares each rank with
its replicas only, as the agent does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpumon.report.make import load
from gpumon.report.page import render
from gpumon.testing.recordings import Run, write
from tests.helpers import ROOT, agent_env
from tests.report.browser import open_page
from tests.report.pipeline import table_rows
from tests.report.pipeline import write as write_pipeline


def test_the_page_names_each_ranks_layout_own_work_bubble_and_the_slowest_stage(
        tmp_path: Path) -> None:
    model = load(write_pipeline(tmp_path / "gpt.jsonl"))
    assert {r: (layout.pp, layout.dp) for r, layout in model.layouts.items()} == {
        0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert model.own_work_s == pytest.approx({0: 0.16, 1: 0.16, 2: 0.36, 3: 0.36})
    assert model.bubble_share == pytest.approx({0: 0.5, 1: 0.5, 2: 0.075, 3: 0.075})
    page = render(model)
    assert table_rows(page) == [
        ["rank", "layout", "own work per step", "bubble", ""],
        ["rank 0", "pp0 dp0", "0.16 s", "50%", ""],
        ["rank 1", "pp0 dp1", "0.16 s", "50%", ""],
        ["rank 2", "pp1 dp0", "0.36 s", "8%", "slowest stage"],
        ["rank 3", "pp1 dp1", "0.36 s", "8%", "slowest stage"],
    ]
    # 0.36 over the stages' mean of 0.16 and 0.36: past GpumonPipelineImbalance's 1.25
    assert ('<p class="note" id="slowest-stage">Stage 1 is the slowest pipeline stage: 0.36 s of '
            "own work per step, 1.38× the stages&#x27; mean; the other stages wait for it in "
            "their bubble.</p>") in page
    assert ("<tr><th>slowest pipeline stage</th><td>stage 1: 1.38× the stages&#x27; mean own "
            "work per step</td></tr>") in page
    meta = json.loads(page.split('id="gpumon-report">', 1)[1].split("</script>", 1)[0])
    assert meta["figures"][-1] == "pipeline-bubble"
    # Each stage is compared with its replica only: the heavy stage is no straggler.
    assert model.summary.stragglers == {}


def test_without_the_layouts_the_heavy_stage_reads_as_a_straggler(tmp_path: Path) -> None:
    """What the hellos change: compared with the whole run, stage 1's ranks lag (own work 0.36
    against their peers' 0.23). Its bubble still says the run receives: the section stays,
    with no layout and no stage to name."""
    model = load(write_pipeline(tmp_path / "gpt.jsonl", hellos=False))
    assert set(model.summary.stragglers) == {2, 3}
    page = render(model)
    assert table_rows(page)[3] == ["rank 2", "—", "0.36 s", "8%", ""]
    assert "slowest-stage" not in page and "slowest pipeline stage" not in page


def test_a_run_that_does_not_split_its_model_has_the_page_it_had(tmp_path: Path) -> None:
    model = load(write(tmp_path / "ddp.jsonl", Run(steps=30)))
    assert model.layouts == {} and model.bubble_share == {} and model.bubble == {}
    page = render(model)
    assert "Model parallelism" not in page and "parallelism" not in page.split("</style>")[1]
    assert "pipeline-bubble" not in page


def test_the_pipeline_page_draws_the_bubble_per_rank_in_a_browser(tmp_path: Path) -> None:
    recording = write_pipeline(tmp_path / "gpt.jsonl")
    page = tmp_path / "gpt.html"
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "report", str(recording),
                             "-o", str(page)], capture_output=True, text=True, env=agent_env(),
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    drawn = open_page(page, tmp_path, width=390)
    assert drawn["errors"] == []
    bubble = drawn["figures"]["pipeline-bubble"]
    assert bubble["svg"] >= 1 and bubble["drawn"] == 4
    shares = {t["name"]: {round(v) for v in t["y"] if v is not None} for t in bubble["data"]}
    assert shares == {"rank 0 (pp0 dp0)": {50}, "rank 1 (pp0 dp1)": {50},
                      "rank 2 (pp1 dp0)": {8}, "rank 3 (pp1 dp1)": {8}}
    assert drawn["overflow"] <= 0  # the table fits a phone's width
