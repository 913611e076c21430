"""The agent's trace desk on its own: the directory kept within its bound (oldest first, never
the trace just written) and the automatic rule (a straggler, or communication/host for N
windows in a row; at most one trace per rank per period; off by default). The rule's requests
are recorded in place of being sent: what a request does is tests/e2e/test_traces.py's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpumon.agent.config import AgentConfig
from gpumon.agent.traces import TraceDesk, TraceSettings, trace_settings
from gpumon.analysis.bottleneck import Bottleneck, Verdict
from gpumon.analysis.straggler import StragglerCause
from gpumon.analysis.stream import RankAnalysis
from gpumon.state.ranks import RankStore


def desk(tmp_path: Path, **settings: object) -> TraceDesk:
    base = {"directory": str(tmp_path), "max_bytes": 2500, "steps": 3, "auto": True,
            "auto_windows": 2, "auto_every_s": 600.0}
    return TraceDesk(TraceSettings(**{**base, **settings}), str(tmp_path / "s.sock"),  # type: ignore[arg-type]
                     RankStore())


def test_the_oldest_traces_go_once_the_directory_holds_more_than_its_bound(tmp_path: Path) -> None:
    names = [f"r.rank0.step{i}.pt.trace.json.gz" for i in range(4)]
    for age, name in enumerate(reversed(names)):
        path = tmp_path / name
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1_000_000 - age * 10, 1_000_000 - age * 10))  # step0 oldest
    (tmp_path / "unrelated.txt").write_bytes(b"y" * 5000)
    traces = desk(tmp_path)
    traces.bound_disk(keep=str(tmp_path / names[0]))  # the oldest, but just written
    traces.stop()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([names[0], names[3], "unrelated.txt"]), left


def analysis(rank: int, step: int, primary: Bottleneck, straggler: bool = False) -> RankAnalysis:
    verdict = Verdict(primary, 0.9, {}, frozenset(), "")
    return RankAnalysis("run", rank, verdict=verdict, verdict_step=step,
                        straggler_cause=StragglerCause.COMPUTE if straggler else None)


def test_the_rule_asks_once_per_rank_and_period(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    traces = desk(tmp_path)
    asked: list[tuple[str, int, str]] = []
    monkeypatch.setattr(traces, "request", lambda run, rank, trigger: asked.append((run, rank, trigger)))
    comm, compute = Bottleneck.COMMUNICATION, Bottleneck.COMPUTE
    traces.observe([analysis(0, 10, comm), analysis(1, 10, compute, straggler=True)])
    assert asked == [("run", 1, "straggler")]  # turned straggler: at once
    traces.observe([analysis(0, 10, comm)])  # the same window again: still one
    traces.observe([analysis(0, 20, compute)])  # the run of windows broken
    traces.observe([analysis(0, 30, comm)])
    assert asked == [("run", 1, "straggler")]
    traces.observe([analysis(0, 40, comm)])  # two windows in a row
    assert asked[-1] == ("run", 0, "communication")
    for step in range(50, 200, 10):  # still communication-bound: not again within the period
        traces.observe([analysis(0, step, comm), analysis(1, step, compute, straggler=True)])
    traces.stop()
    assert len(asked) == 2


def test_the_rule_is_off_by_default(tmp_path: Path) -> None:
    assert trace_settings(AgentConfig()).auto is False
    assert AgentConfig().trace_dir == "/var/tmp/gpumon-traces"
