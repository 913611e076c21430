"""`gpumon report` on bad input: what it can read, it reports; what it cannot, it says."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumon.report.make import load
from gpumon.report.model import MAX_BINS
from gpumon.report.replay import quick_scan, scan
from gpumon.testing.recordings import Run, write
from tests.helpers import ROOT, agent_env, free_port


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumon.cli", "report", *args],
                          capture_output=True, text=True, env=agent_env(), cwd=ROOT, timeout=120)


def test_a_torn_and_corrupt_recording_is_reported_as_far_as_it_reads(tmp_path: Path) -> None:
    lines = write(tmp_path / "run.jsonl", Run(steps=40)).read_text().splitlines()
    steps = sum(json.loads(line)["kind"] == "step" for line in lines)
    lines.insert(5, "\x00\x00garbage{")
    torn = "\n".join(lines)[:-40]  # an agent killed mid-write: the last step is cut
    (tmp_path / "torn.jsonl").write_text(torn)
    page = tmp_path / "torn.html"
    result = report(str(tmp_path / "torn.jsonl"), "-o", str(page))
    assert result.returncode == 0, result.stderr
    assert f"{steps - 1} steps of 3 ranks" in result.stdout
    assert "2 unreadable lines were skipped (not_json: 2, first at lines 6, " in result.stderr
    assert "2 unreadable lines were skipped" in page.read_text()


def test_an_unknown_run_lists_the_runs_there_are(tmp_path: Path) -> None:
    path = tmp_path / "two.jsonl"
    write(path, Run(run="a", ranks=2, steps=10))
    with open(path, "a") as out:
        out.write(write(tmp_path / "b.jsonl", Run(run="b", ranks=2, steps=5)).read_text())
    result = report(str(path), "--run", "nope", "-o", str(tmp_path / "x.html"))
    assert result.returncode == 1
    assert f"no run 'nope' in {path}; the runs there are: 'a' (20 steps), 'b' (10 steps)" \
        in result.stderr
    result = report(str(path), "-o", str(tmp_path / "x.html"))
    assert result.returncode == 1 and "holds several runs; choose one with --run" in result.stderr
    assert not (tmp_path / "x.html").exists()
    assert report(str(path), "--run", "b", "-o", str(tmp_path / "x.html")).returncode == 0


def test_neither_or_both_sources_is_a_usage_error(tmp_path: Path) -> None:
    result = report()
    assert result.returncode == 2 and "give a RECORDING or --prometheus URL" in result.stderr
    result = report(str(tmp_path / "missing.jsonl"))
    assert result.returncode == 1 and "cannot read" in result.stderr


def test_an_unreachable_prometheus_is_named(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = report("--prometheus", url, "--run", "llm", "-o", str(tmp_path / "x.html"))
    assert result.returncode == 1
    assert f"cannot reach {url}:" in result.stderr and "Connection refused" in result.stderr
    result = report("--prometheus", url, "--run", "llm", "--since", "soon")
    assert result.returncode == 1 and "--since 'soon'" in result.stderr


def test_a_prometheus_that_does_not_answer_is_named_within_the_timeout(tmp_path: Path) -> None:
    """A listening socket that never accepts stands for a server that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        began = time.monotonic()
        result = report("--prometheus", url, "--run", "llm", "--timeout", "1")
        took = time.monotonic() - began
    finally:
        server.close()
    assert result.returncode == 1
    assert f"{url} did not answer within 1 s" in result.stderr
    assert took < 30  # the interpreter's start and the one-second wait, not a hang


def test_a_long_run_is_drawn_in_bounded_bins(tmp_path: Path) -> None:
    run = Run(ranks=2, steps=4000, step_s=0.5, gpu_every_s=10.0, peak_growth=0)
    model = load(write(tmp_path / "long.jsonl", run))
    assert model.bins == MAX_BINS
    assert model.summary.steps == 8000
    assert all(len(mean.counts) == MAX_BINS for mean in model.step_time.values())
    # Every bin holds the steps that ended in it: none is lost to the downsampling.
    assert sum(sum(mean.counts) for mean in model.step_time.values()) == 8000


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_an_empty_recording_says_so(tmp_path: Path, text: str) -> None:
    (tmp_path / "empty.jsonl").write_text(text)
    result = report(str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "x.html"))
    assert result.returncode == 1 and "holds no steps of any run" in result.stderr


def test_a_recording_with_no_readable_step_says_why(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"kind": "step", "run": "x"}\nnot json\n')
    result = report(str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "x.html"))
    assert result.returncode == 1
    assert "holds no readable step: 2 unreadable lines were skipped (" in result.stderr
    assert "first at lines 1, 2)" in result.stderr


def test_a_step_line_the_replay_skips_counts_nowhere(tmp_path: Path) -> None:
    """A step line in the agent's form whose record does not pass (a negative rank), ending
    hours after the run: the first pass's guess takes it, yet the run's span, bins and figures
    are those of the recording without it, which the page says it skipped."""
    lines = write(tmp_path / "run.jsonl", Run(steps=40)).read_text().splitlines()
    bad = json.loads(next(line for line in lines if '"kind":"step"' in line))
    bad.update(rank=-1, t_start=bad["t_start"] + 36_000.0)
    (tmp_path / "clean.jsonl").write_text("\n".join(lines) + "\n")
    bad_line = json.dumps(bad, separators=(",", ":"))  # in the agent's own form
    (tmp_path / "bad.jsonl").write_text("\n".join([*lines[:9], bad_line, *lines[9:]]))
    clean, skipped = load(tmp_path / "clean.jsonl"), load(tmp_path / "bad.jsonl")
    assert (skipped.start, skipped.end, skipped.bins) == (clean.start, clean.end, clean.bins)
    assert skipped.summary == clean.summary
    assert {r: m.values() for r, m in skipped.step_time.items()} \
        == {r: m.values() for r, m in clean.step_time.items()}
    assert skipped.notes == ["1 unreadable lines were skipped (bad_value: 1, first at lines 10); "
                             "the report covers the rest"]


def test_the_quick_first_pass_reads_what_the_checked_one_does(tmp_path: Path) -> None:
    """On a recording in the agent's form, with its time lines, the guess is the checked scan
    (else every report would be replayed twice), and a line in another JSON form is read alike."""
    lines = write(tmp_path / "run.jsonl", Run(steps=40, times=True)).read_text().splitlines()
    lines[7] = json.dumps(json.loads(lines[7]))  # spaces after the separators
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with open(path) as quick, open(path) as checked:
        assert quick_scan(quick) == scan(checked)
