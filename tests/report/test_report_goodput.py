"""A real run restarted after a crash, in ``/metrics`` and in `gpumon report`: a torchrun job (no
gpumon code in it, under ``gpumon run``) whose rank 1 dies mid-step, restarted by torchrun from
its last checkpoint, under an agent that records. While the agent runs, each rank's goodput plus
badput is its wall time within 10 % and each cause within 30 % of the job's own timeline
(``tests/e2e/timelines.py``), with one restart and one restore each. Once the agent has stopped
(writing each rank's last time line), the report made from its recording gives the run's
goodput ratio and largest loss as the recording's time lines say them, and within the same
tolerances of the job's own timeline; the page marks each rank's restart on the step time's
axis within a second of the moment its successor process started, by the job's notes."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from gpumon.analysis.goodput import CAUSES
from gpumon.report.goodput import TIME_FIGURE, run_time
from gpumon.report.make import load, write
from gpumon.testing import AgentProcess
from gpumon.testing.metrics import first
from tests.e2e.distributed import AGENT, RESTART_EVERY, RESTART_STEPS, restarted_job
from tests.e2e.timelines import check, measured, notes, rank_truth
from tests.report.browser import open_page

pytestmark = [pytest.mark.slow, AGENT]

RUN = "restart-report"


def recorded_times(recording: Path) -> dict[int, dict[str, Any]]:
    """Each rank's latest time line of the run, read straight from the recording."""
    latest: dict[int, dict[str, Any]] = {}
    for text in recording.read_text().splitlines():
        line = json.loads(text)
        if line.get("kind") == "time" and line["run"] == RUN:
            if line["t"] >= latest.get(line["rank"], {"t": float("-inf")})["t"]:
                latest[line["rank"]] = line
    return latest


def test_the_report_of_a_restarted_run_shows_where_its_time_went(agent: AgentProcess,
                                                                 tmp_path: Path) -> None:
    job = restarted_job(agent, tmp_path, RUN)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and first(
            agent.metrics(), "gpumon_unsaved_seconds", run=RUN, rank="1") != 0.0:
        time.sleep(0.25)  # the last records (the clean finish) arrive
    for rank in (0, 1):  # what the agent says, against the job's own timeline
        live = measured(agent, RUN, rank)
        check(rank_truth(job.out, rank), live, f"rank {rank}")
        assert live["unsaved"] == 0.0 and live["restarts"] == 1 and live["loads"] == 1, live
        assert live["saves"] == (RESTART_STEPS // RESTART_EVERY if rank == 0 else 0), live
    assert agent.stop() == 0, agent.log()[-3000:]  # its stop writes each rank's last time line

    model = load(job.recording, run=RUN)
    lines = recorded_times(job.recording)
    assert sorted(model.time_totals) == sorted(lines) == [0, 1]
    got = run_time(model)
    assert got is not None and got.ratio is not None
    # What the recording's time lines say, summed over the ranks.
    goodput = sum(line["goodput"] for line in lines.values())
    badput = {c: sum(line["badput"][c] for line in lines.values()) for c in CAUSES}
    settled = goodput + sum(badput.values())
    largest = max(CAUSES, key=lambda c: badput[c])
    assert got.ratio == pytest.approx(goodput / settled, rel=1e-9)
    assert got.largest_loss() == (largest, pytest.approx(badput[largest], rel=1e-9))
    assert got.unsaved_s == 0.0 and got.restarts == 2  # finished cleanly; each rank restarted

    # What the job's own timeline says.
    truths = [rank_truth(job.out, rank) for rank in (0, 1)]
    want = {part: sum(t[part] for t in truths) for part in ("goodput", "wall", *CAUSES)}
    report = f"truth {want}, report {got}"
    assert got.settled_s == pytest.approx(want["wall"], rel=0.10), report
    assert got.goodput_s == pytest.approx(want["goodput"], rel=0.30), report
    assert got.ratio == pytest.approx(want["goodput"] / want["wall"], rel=0.30), report
    assert largest == max(CAUSES, key=lambda c: want[c]), report
    share = badput[largest] / settled
    assert share == pytest.approx(want[largest] / want["wall"], rel=0.30), report

    # The page: the summary's words, each rank's bar, the restart markers.
    page = tmp_path / "report.html"
    write(model, page)
    text = page.read_text()
    summary = text.split('<table id="summary">', 1)[1].split("</table>", 1)[0]
    assert f"Goodput {got.ratio:.0%} of " in summary
    assert f"largest loss: {largest} ({share:.0%})" in summary
    drawn = open_page(page, tmp_path)
    assert drawn["errors"] == []
    assert TIME_FIGURE in drawn["meta"]["figures"]
    bars = {t["name"]: t for t in drawn["figures"][TIME_FIGURE]["data"]}
    assert bars["goodput"]["y"] == ["rank 0", "rank 1"]
    assert bars["goodput"]["x"] == pytest.approx([lines[r]["goodput"] for r in (0, 1)], rel=1e-4)
    assert bars[largest]["x"] == pytest.approx([lines[r]["badput"][largest] for r in (0, 1)],
                                               rel=1e-4)
    markers = drawn["figures"]["step-phases"]["notes"]
    start = drawn["meta"]["start"]
    for rank in (0, 1):
        successor = next(e["at"] for e in notes(job.out / f"rank{rank}.attempt1.jsonl")
                         if e["what"] == "start")
        assert model.time_totals[rank].restarted_at == (pytest.approx(successor, abs=1.0),)
        near = [m for m in markers if abs(m["x"] - (successor - start)) <= 1.0
                and str(rank) in re.findall(r"\d+", m["text"])]
        assert near, (rank, successor - start, markers)
