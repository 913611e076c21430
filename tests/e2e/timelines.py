"""Where a job's time went by its own notes (``jobs/timeline.py``): the truth the goodput tests
hold gpumon's accounting to, computed from nothing of gpumon's.

A process's life runs from its kernel start time to its watcher's ``gone``. A job's attempts
are its processes for one rank, in order; ``saves`` are the notes of the
process that saves (the rank itself, or rank 0 for a job where it alone writes). A save
preserves the steps up to its step once it is done (``save_done``); the steps of a process that
crashed after its last completed save are lost; every other completed step is goodput.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gpumon.analysis.goodput import CAUSES
from gpumon.testing import AgentProcess
from gpumon.testing.metrics import value

Events = list[dict[str, Any]]


def notes(path: Path, wait_s: float = 10.0) -> Events:
    """A process's notes, once its watcher has noted it gone (within ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        events = [json.loads(line) for line in path.read_text().splitlines()]
        if any(e["what"] == "gone" for e in events) or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def rank_truth(out: Path, rank: int, attempts: int = 2) -> dict[str, float]:
    """``truth`` of one rank of ``jobs/restart_job.py`` (rank 0 saves for the run)."""
    return truth([notes(out / f"rank{rank}.attempt{n}.jsonl") for n in range(attempts)],
                 [notes(out / f"rank0.attempt{n}.jsonl") for n in range(attempts)])


def truth(attempts: list[Events], saves: list[Events] | None = None) -> dict[str, float]:
    """The rank's time by cause, its goodput and its wall time, in seconds."""
    saves = saves if saves is not None else attempts
    got: dict[str, float] = dict.fromkeys((*CAUSES, "goodput"), 0.0)
    for n, events in enumerate(attempts):
        start = _first(events, "start")["at"]
        got["startup"] += _first(events, "step_start")["t"] - start
        exit_ = _first(events, "exit")
        crashed = exit_["why"] != "done"
        gone = _first(events, "gone")["t"]  # the process's end, by the kernel
        done = [e for e in saves[n] if e["what"] == "save_done" and e["t"] <= gone]
        kept = max((e["step"] for e in done), default=0) if crashed else float("inf")
        begun: dict[int, float] = {}
        saving: dict[int, float] = {}
        for e in events:
            if e["what"] == "step_start":
                begun[e["step"]] = e["t"]
            elif e["what"] == "step_end":
                got["goodput" if e["step"] <= kept else "lost"] += e["t"] - begun[e["step"]]
            elif e["what"] == "save_start":
                saving[e["step"]] = e["t"]
            elif e["what"] == "save_end":
                got["checkpoint"] += e["t"] - saving[e["step"]]
        if n + 1 < len(attempts):
            got["restart"] += _first(attempts[n + 1], "start")["at"] - gone
    got["wall"] = _first(attempts[-1], "gone")["t"] - _first(attempts[0], "start")["at"]
    return got


def _first(events: Events, what: str) -> dict[str, Any]:
    return next(e for e in events if e["what"] == what)


def measured(agent: AgentProcess, run: str, rank: int) -> dict[str, float]:
    """Where the agent says the rank's time went (``/metrics``), with its restarts and
    checkpoints."""
    metrics = agent.metrics()
    labels = {"run": run, "rank": str(rank)}
    got = {cause: value(metrics, "gpumon_badput_seconds_total", cause=cause, **labels)
           for cause in CAUSES}
    got["goodput"] = value(metrics, "gpumon_goodput_seconds_total", **labels)
    got["unsaved"] = value(metrics, "gpumon_unsaved_seconds", **labels)
    got["restarts"] = value(metrics, "gpumon_rank_restarts_total", **labels)
    got["saves"] = value(metrics, "gpumon_checkpoints_total", kind="save", result="ok", **labels)
    got["loads"] = value(metrics, "gpumon_checkpoints_total", kind="load", result="ok", **labels)
    return got


def check(want: dict[str, float], got: dict[str, float], who: str,
          causes: tuple[str, ...] = ("goodput", "startup", "checkpoint", "lost", "restart")) -> None:
    """Every second counted once (within 10 %), each cause within 30 % of the truth."""
    report = f"{who}: truth {want}, gpumon {got}"
    total = got["goodput"] + sum(got[c] for c in CAUSES)
    assert total == pytest.approx(want["wall"], rel=0.10), report
    for part in causes:
        assert got[part] == pytest.approx(want[part], rel=0.30), (part, report)
