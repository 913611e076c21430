"""Where a run's time went, on the page: each rank's time figures taken from its latest time
line in the recording (or from Prometheus' counters), the summary's goodput ratio and largest
loss computed from them, the bars by cause and the restart markers; and a recording made before
the agent accounted time gets no goodput words and no figure."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gpumon.agent.recorder import time_from_line, time_line
from gpumon.analysis.goodput import CAUSES, TimeTotals
from gpumon.report.goodput import (
    PARTS,
    TIME_FIGURE,
    goodput_rows,
    restart_groups,
    run_time,
    time_figure,
)
from gpumon.report.make import load
from gpumon.report.model import RunModel
from gpumon.report.page import render
from gpumon.report.prometheus import restart_moments
from gpumon.testing.recordings import Run, time_figures, write

RUN = Run(ranks=3, steps=60, times=True)


def time_totals(run: Run, rank: int) -> TimeTotals:
    """The figures of the rank's time line in the recording, as the agent reads its own."""
    return time_from_line(time_figures(run, rank))[3]


def summary_rows(page: str) -> dict[str, str]:
    table = page.split('<table id="summary">', 1)[1].split("</table>", 1)[0]
    return dict(tuple(row.split("</th><td>", 1)) for row in  # type: ignore[misc]
                table.removeprefix("<tr><th>").removesuffix("</td></tr>")
                .split("</td></tr><tr><th>"))


def test_each_ranks_latest_time_line_is_its_figures(tmp_path: Path) -> None:
    path = write(tmp_path / "run.jsonl", RUN)
    earlier = replace(time_totals(RUN, 0), goodput_s=1.0)  # an earlier line: superseded
    other = time_line("another-run", 0, time_totals(RUN, 2), lambda t: t, RUN.t0)
    with open(path, "a") as out:
        out.write(json.dumps(time_line(RUN.run, 0, earlier, lambda t: t, RUN.t0 + 5)) + "\n")
        out.write(json.dumps(other) + "\n")
        out.write('{"kind": "time", "run": "llm", "rank": 1}\n')  # unreadable: skipped, said
    model = load(path, run=RUN.run)
    assert model.time_totals == {rank: time_totals(RUN, rank) for rank in range(RUN.ranks)}
    assert any("bad_time_line: 1" in note for note in model.notes)


def test_the_summary_gives_the_goodput_ratio_and_the_largest_loss(tmp_path: Path) -> None:
    model = load(write(tmp_path / "run.jsonl", RUN))
    figures = [time_totals(RUN, rank) for rank in range(RUN.ranks)]
    goodput = sum(t.goodput_s for t in figures)
    badput = {c: sum(t.badput_s[c] for t in figures) for c in CAUSES}
    settled = goodput + sum(badput.values())
    got = run_time(model)
    assert got is not None
    assert got.settled_s == pytest.approx(settled) and got.restarts == 1
    assert got.ratio == pytest.approx(goodput / settled)
    # The three ranks' startups (2, 3 and 4 s) outweigh rank 1's lost 10 % of a 24 s span.
    assert got.largest_loss() == ("startup", 9.0)
    rows = summary_rows(render(model))
    assert rows["goodput"] == (f"Goodput {goodput / settled:.0%} of {settled:.3g} rank-seconds; "
                               f"largest loss: startup ({9 / settled:.0%}); 1.44 rank-seconds "
                               "unsaved, not counted until kept or lost")
    assert rows["restarts"] == "1 (rank 1)"


def test_the_bars_stack_each_ranks_parts_in_one_order_and_the_restarts_are_marked(
        tmp_path: Path) -> None:
    model = load(write(tmp_path / "run.jsonl", RUN))
    fig = time_figure(model)
    assert fig is not None
    names = [trace.name for trace in fig.data]
    assert names == [p for p in PARTS if p in {"goodput", "unsaved", "startup", "checkpoint",
                                               "lost", "restart", "other"}]
    for trace in fig.data:
        assert list(trace.y) == ["rank 0", "rank 1", "rank 2"]
        want = [time_totals(RUN, rank) for rank in range(3)]
        part = trace.name
        assert list(trace.x) == pytest.approx([
            t.goodput_s if part == "goodput" else t.unsaved_s if part == "unsaved"
            else t.badput_s[part] for t in want])
    assert restart_groups(model) == [(RUN.t0 + RUN.steps * RUN.step_s / 2, [1])]
    page = render(model)
    assert f'id="{TIME_FIGURE}"' in page and "\\u21bb rank 1" in page  # plotly's JSON


def test_restarts_at_one_moment_share_a_marker_naming_their_ranks(tmp_path: Path) -> None:
    model = load(write(tmp_path / "run.jsonl", RUN))
    restarted = replace(time_totals(RUN, 0), restarts=1, restarted_at=(RUN.t0 + 12.1,))
    model.time_totals[0] = restarted
    model.time_totals[2] = replace(restarted, restarted_at=(RUN.t0 + 20.0,))
    assert restart_groups(model) == [(RUN.t0 + 12.0, [1, 0]), (RUN.t0 + 20.0, [2])]
    assert goodput_rows(model)[1] == ("restarts", "3 (ranks 0, 1, 2)")


def test_a_recording_without_time_lines_says_nothing_of_goodput(tmp_path: Path) -> None:
    model = load(write(tmp_path / "old.jsonl", replace(RUN, times=False)))
    assert model.time_totals == {} and run_time(model) is None
    assert goodput_rows(model) == [] and time_figure(model) is None
    page = render(model)
    assert "goodput" not in summary_rows(page) and "restarts" not in summary_rows(page)
    assert "Goodput" not in page and TIME_FIGURE not in page and "\\u21bb" not in page


def test_no_settled_time_and_nothing_lost_are_said_as_such() -> None:
    nothing = TimeTotals(0.0, dict.fromkeys(CAUSES, 0.0), 5.0, 0)
    kept = TimeTotals(10.0, dict.fromkeys(CAUSES, 0.0), 0.0, 0)
    model = load_free({0: nothing})
    assert goodput_rows(model) == [("goodput", "no time settled yet (no step kept or lost, "
                                    "nothing else counted); 5 rank-seconds unsaved, not "
                                    "counted until kept or lost")]
    model.time_totals = {0: kept}
    assert goodput_rows(model) == [("goodput", "Goodput 100% of 10 rank-seconds; nothing lost")]


def load_free(times: dict[int, TimeTotals]) -> RunModel:
    """A model holding only time figures."""
    model = RunModel(run="r", source="test", start=0.0, end=10.0, bins=10)
    model.time_totals = dict(times)
    return model


def test_restart_moments_are_where_the_counter_went_up() -> None:
    assert restart_moments([]) == []
    assert restart_moments([(0.0, 0.0), (15.0, 0.0), (30.0, 1.0), (45.0, 1.0), (60.0, 3.0)]) == [
        30.0, 60.0, 60.0]
    # An agent restarted: its counter starts again from 0; only its increases are restarts.
    assert restart_moments([(0.0, 2.0), (15.0, 0.0), (30.0, 1.0)]) == [30.0]
