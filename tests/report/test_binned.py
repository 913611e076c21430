"""The page's bins filled by a forked child beside the verdict engine give the page filling
them in one process gives; a child that fails leaves them to the parent, and a parent that
fails leaves no child behind."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil
import pytest

from gpumon.report import recording
from gpumon.report.page import render
from gpumon.testing.recordings import Run, write


@pytest.fixture(scope="module")
def day(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four ranks, a straggler among them, GPU samples every second: 160 s of steps, more
    than the replay's reorder window."""
    path = tmp_path_factory.mktemp("binned") / "run.jsonl"
    return write(path, Run(ranks=4, steps=400, step_s=0.4))


def _page(path: Path, split: bool, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(recording, "worth_it", lambda: split)
    return render(recording.load_file(path))


def test_the_child_fills_the_bins_the_parent_would(day: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    parent = os.getpid()
    in_parent: list[int] = []
    real_step = recording._Filler.step

    def step(filler: recording._Filler, record: object) -> None:
        if os.getpid() == parent:
            in_parent.append(1)
        real_step(filler, record)  # type: ignore[arg-type]

    monkeypatch.setattr(recording._Filler, "step", step)
    one = _page(day, False, monkeypatch)
    assert len(in_parent) == 1600
    in_parent.clear()
    split = _page(day, True, monkeypatch)
    assert in_parent == []  # every step was binned by the child
    assert split == one


def test_a_child_that_fails_leaves_the_bins_to_the_parent(
        day: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    one = _page(day, False, monkeypatch)
    parent = os.getpid()
    real_fill = recording.fill_bins

    def fill_failing_in_the_child(path: Path, run: str, filler: object) -> None:
        if os.getpid() != parent:
            raise MemoryError("the child ran out")
        real_fill(path, run, filler)  # type: ignore[arg-type]

    monkeypatch.setattr(recording, "fill_bins", fill_failing_in_the_child)
    with caplog.at_level(logging.WARNING, logger="gpumon.report.binned"):
        split = _page(day, True, monkeypatch)
    assert split == one
    assert "filling them here" in caplog.text


def test_a_parent_that_fails_leaves_no_child(day: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_replay(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # the user gave up waiting

    monkeypatch.setattr(recording, "replay", failing_replay)
    monkeypatch.setattr(recording, "worth_it", lambda: True)
    with pytest.raises(KeyboardInterrupt):
        recording.load_file(day)
    assert psutil.Process().children() == []
