"""Rank states from the rank store: state records kept apart from the step series, exits
marked and undone by a restart, the conditions rendered as metrics and as ``gpumon stacks``."""

from __future__ import annotations

from gpumon.agent.views import _condition_dict
from gpumon.collectors.samples import SenderCredentials
from gpumon.commands.stacks import render, stacks_document
from gpumon.export.exposition import render as render_families
from gpumon.export.rank_state_metrics import rank_state_families
from gpumon.state.rank_states import rank_conditions
from gpumon.state.ranks import RankStore
from gpumon.testing import parse_metrics
from gpumon.testing.metrics import series
from gpumon.wire import InFlight, StackFrame, StateRecord, StepRecord

T = 1_700_000_000.0
RANK0, RANK1 = SenderCredentials(pid=100, uid=1000), SenderCredentials(pid=101, uid=1000)


def step(rank: int, n: int) -> StepRecord:
    return StepRecord("r", rank, n, 0.1, world=2, t_start=T + n * 0.1)


def stalled(rank: int, seq: int | None, phase: str, function: str) -> StateRecord:
    flight = None if seq is None else InFlight("all_reduce", seq, 1024, T + 1.0, False)
    stack = (StackFrame("python3.11/threading.py", 320, "Condition.wait", False),
             StackFrame("jobs/train.py", 12, function, True))
    return StateRecord("r", rank, "stalled", T + 5, 10, since=T + 1.5, threshold_s=1.0, phase=phase,
                       launched=seq or 10, in_flight=flight, stack=stack)


def store_with_a_stall() -> RankStore:
    store = RankStore()
    for n in range(10):
        store.ingest([step(0, n)], RANK0, 10.0 + n * 0.1, T + n * 0.1)
        store.ingest([step(1, n)], RANK1, 10.0 + n * 0.1, T + n * 0.1)
    return store


def test_a_state_record_is_kept_without_touching_the_step_series() -> None:
    store = store_with_a_stall()
    before = {s.rank: s.version for s in store.ranks()}
    store.ingest([stalled(0, 11, "backward", "train_step")], RANK0, 16.0, T + 5)
    after = {s.rank: s for s in store.ranks()}
    assert after[0].version == before[0] and after[0].report is not None
    assert store.counters()[0]["state"] == 1


def test_the_conditions_render_as_the_three_families_and_as_stacks() -> None:
    store = store_with_a_stall()
    store.ingest([stalled(0, 11, "backward", "train_step")], RANK0, 16.0, T + 5)
    store.ingest([stalled(1, None, "data", "read_shard")], RANK1, 16.0, T + 5)
    conditions = rank_conditions(store.ranks(), 17.0)
    metrics = parse_metrics(render_families(list(rank_state_families(conditions))).decode())
    states = {(lab["rank"], lab["state"]): v for lab, v in series(metrics, "gpumon_rank_state")}
    assert states[("0", "stalled")] == 1.0 and states[("0", "stepping")] == 0.0
    [(info0, _)] = series(metrics, "gpumon_rank_stall_info", rank="0")
    assert info0["waits_on"] == "1" and info0["op"] == "all_reduce"
    assert info0["location"] == "train.py:12 train_step"
    [(_, stalled_s)] = series(metrics, "gpumon_rank_stalled_seconds", rank="1")
    assert stalled_s == 3.5 + 1.0  # since its last progress, until the report, and its age

    snapshot = {"t": T + 6, "ranks": [
        {"run": "r", "rank": s.rank, "pid": s.pid, "steps_total": s.steps_total,
         "condition": _condition_dict(conditions[("r", s.rank)])} for s in store.ranks()]}
    text = render(stacks_document(snapshot, "r"), now_unix_s=T + 6)
    assert "run r: 2 stalled" in text
    assert "in collective: all_reduce #11 (1024 bytes, for 5 s)" in text
    assert "waits on: rank(s) 1" in text and "in collective: none (10 launched so far)" in text
    lines = text.splitlines()
    own, other = "    job frames (innermost first):", "    other frames (innermost first):"
    assert lines.index(own) < lines.index(other)
    assert stacks_document(snapshot, "other")["runs"] == {}


def test_an_exit_is_kept_until_a_new_process_reports_for_the_rank() -> None:
    store = store_with_a_stall()
    assert store.watched_pids() == {100: [("r", 0)], 101: [("r", 1)]}
    store.mark_exited({101}, 20.0)
    assert rank_conditions(store.ranks(), 21.0)[("r", 1)].state == "exited"
    assert store.watched_pids() == {100: [("r", 0)]}
    store.ingest([step(1, 0)], SenderCredentials(pid=202, uid=1000), 30.0, T + 0.1)
    assert rank_conditions(store.ranks(), 31.0)[("r", 1)].state == "stepping"
    metrics = parse_metrics(render_families(list(rank_state_families(
        rank_conditions(store.ranks(), 31.0)))).decode())
    assert series(metrics, "gpumon_rank_stall_info") == []
