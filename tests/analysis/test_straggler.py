"""The straggler comparison: who waits for whom in a synchronous run, and why the slow rank is slow.

``sync_steps`` builds one step of every rank the way synchronous data parallelism times it:
the all-reduce ends only once the last rank is ready, every rank's step lasts the same, and a
rank's wait for the others sits inside its ``backward`` phase, as the hook sees it under DDP.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpumon.analysis.bottleneck import Bottleneck, Flag, StepEvidence, Verdict, classify
from gpumon.analysis.straggler import (
    STRAGGLER_MIN_STEPS,
    RankWork,
    SlowerRank,
    Standing,
    StragglerCause,
    judge_run,
    own_work_s,
    straggler_scores,
)
from gpumon.analysis.stream import StepAnalyzer
from gpumon.analysis.thresholds import DEFAULT
from gpumon.wire import CollectiveOp, CommStats, StepRecord, decode_record

GRADIENTS = 64 * 2**20
TAIL_S = 0.015  # the last bucket's all-reduce once every rank is ready
H100_CLOCK = 1.98e9


def sync_steps(world: int, *, data: float = 0.002, forward: float = 0.030,
               backward: float = 0.060, optimizer: float = 0.006,
               extra: Mapping[int, Mapping[str, float]] | None = None,
               phases: bool = True) -> list[StepRecord]:
    """One synchronous step of ``world`` ranks; ``extra`` adds seconds to a rank's phases."""
    extra = extra or {}
    own = []
    for rank in range(world):
        more = extra.get(rank, {})
        own.append({"data": data + more.get("data", 0.0),
                    "forward": forward + more.get("forward", 0.0),
                    "backward": backward + more.get("backward", 0.0)})
    allreduce_end = max(sum(p.values()) for p in own) + TAIL_S
    steps = []
    for rank, mine in enumerate(own):
        exposed = allreduce_end - sum(mine.values())
        timed = {"data": mine["data"], "forward": mine["forward"],
                 "backward": mine["backward"] + exposed, "optimizer": optimizer}
        busy = exposed + 0.7 * mine["backward"]  # buckets in flight during backward too
        steps.append(StepRecord(
            run="ddp", rank=rank, step=7, duration_s=allreduce_end + optimizer, world=world,
            t_start=0.0, phases_s=timed if phases else {},
            comm=CommStats(exposed, busy, (CollectiveOp("all_reduce", 4, GRADIENTS, busy),))))
    return steps


def works(steps: list[StepRecord], **per_rank: Mapping[int, Any]) -> dict[int, RankWork]:
    out = {}
    for step in steps:
        fields = {name: values[step.rank] for name, values in per_rank.items()
                  if step.rank in values}
        data = step.phases_s.get("data", 0.0) if step.phases_s else None
        out[step.rank] = RankWork(own_work_s(step), data, **fields)
    return out


CLOCKS_4 = {0: H100_CLOCK, 1: H100_CLOCK, 2: 1.5e9, 3: H100_CLOCK}
CASES: list[tuple[str, dict[int, RankWork], dict[int, StragglerCause]]] = [
    ("2 ranks, balanced", works(sync_steps(2)), {}),
    ("8 ranks, balanced", works(sync_steps(8)), {}),
    ("4 ranks, rank 3 +60 ms forward", works(sync_steps(4, extra={3: {"forward": 0.06}})),
     {3: StragglerCause.COMPUTE}),
    ("2 ranks, rank 1's input +60 ms", works(sync_steps(2, extra={1: {"data": 0.06}})),
     {1: StragglerCause.INPUT}),
    ("2 ranks, rank 0 +60 ms backward", works(sync_steps(2, extra={0: {"backward": 0.06}})),
     {0: StragglerCause.COMPUTE}),
    ("2 ranks, rank 0's thread waits 60 ms for a CPU",
     works(sync_steps(2, extra={0: {"backward": 0.06}}), cpu_wait_s={0: 0.062, 1: 0.003}),
     {0: StragglerCause.HOST}),
    ("2 ranks, rank 0 +60 ms backward, 20 ms of it a wait for a CPU",
     works(sync_steps(2, extra={0: {"backward": 0.06}}), cpu_wait_s={0: 0.02, 1: 0.0}),
     {0: StragglerCause.COMPUTE}),
    ("4 ranks, all waiting for CPUs, rank 1 +60 ms forward",
     works(sync_steps(4, extra={1: {"forward": 0.06}}), cpu_wait_s={r: 0.03 for r in range(4)}),
     {1: StragglerCause.COMPUTE}),
    ("4 ranks, rank 2 throttled", works(sync_steps(4, extra={2: {"backward": 0.05}}),
                                        gpu_trouble={2: True}),
     {2: StragglerCause.GPU}),
    ("4 ranks, rank 2 at lower clocks", works(sync_steps(4, extra={2: {"backward": 0.05}}),
                                              sm_clock_hz=CLOCKS_4),
     {2: StragglerCause.GPU}),
    ("every GPU throttled: not the cause", works(sync_steps(4, extra={1: {"forward": 0.05}}),
                                                 gpu_trouble={r: True for r in range(4)}),
     {1: StragglerCause.COMPUTE}),
    ("no phases: the cause is unknown", works(sync_steps(2, extra={1: {"forward": 0.06}},
                                                         phases=False)),
     {1: StragglerCause.UNKNOWN}),
    # near miss: 1.3x its peers' own work of 98 ms (0.75 is 1.33x)
    ("8 ranks, rank 5 at 1.3x", works(sync_steps(8, extra={5: {"forward": 0.3 * 0.098}})), {}),
    ("8 ranks, rank 5 at 1.4x", works(sync_steps(8, extra={5: {"forward": 0.4 * 0.098}})),
     {5: StragglerCause.COMPUTE}),
]


@pytest.mark.parametrize(("name", "run", "expected"), CASES, ids=[c[0] for c in CASES])
def test_the_straggler_is_the_rank_its_peers_wait_for(
    name: str, run: dict[int, RankWork], expected: dict[int, StragglerCause]
) -> None:
    standings = judge_run(run)
    assert {r: s.cause for r, s in standings.items() if s.cause is not None} == expected
    culprit = next(iter(expected), None)
    for rank, standing in standings.items():
        assert standing.score is not None
        if rank != culprit:
            assert standing.score >= 0.75
            assert standing.slower_rank == (SlowerRank(culprit) if culprit is not None else None)
        else:
            assert standing.slower_rank is None


def test_the_slow_rank_waits_least_and_the_sum_of_phases_cannot_see_it() -> None:
    steps = sync_steps(4, extra={3: {"forward": 0.06}})
    assert all(s.duration_s == steps[0].duration_s for s in steps)
    hooked = [s.phases_s["forward"] + s.phases_s["backward"] + s.phases_s["optimizer"]
              for s in steps]
    assert max(hooked) - min(hooked) < 1e-9  # a balanced job's 1.001, 0.999, 0.995, 1.008
    waits = [s.comm.exposed_s for s in steps if s.comm is not None]
    assert waits[3] == pytest.approx(TAIL_S) and waits[0] == pytest.approx(TAIL_S + 0.06)
    scores = straggler_scores({s.rank: own_work_s(s) for s in steps})
    assert scores[3] == pytest.approx(0.098 / 0.158)  # peers' 98 ms own work over its 158 ms
    assert scores[0] == pytest.approx((0.098 * 2 + 0.158) / 3 / 0.098)


def test_a_silent_rank_is_named_when_no_reporting_rank_is_slow() -> None:
    standings = judge_run(works(sync_steps(3)), silent=frozenset({3, 5}))
    assert set(standings) == {0, 1, 2}
    assert {s.slower_rank for s in standings.values()} == {SlowerRank(3, silent=True)}
    assert all(s.cause is None for s in standings.values())
    with_culprit = judge_run(works(sync_steps(3, extra={2: {"forward": 0.06}})),
                             silent=frozenset({3}))
    assert with_culprit[0].slower_rank == SlowerRank(2)  # a reporting straggler explains it


@pytest.mark.parametrize(
    "own",
    [{}, {0: 1.0}, {0: 1.0, 1: 0.0}, {0: 1.0, 1: math.nan}, {0: math.inf, 1: 1.0}],
)
def test_fewer_than_two_comparable_ranks_give_no_scores(own: dict[int, float]) -> None:
    assert straggler_scores(own) == {}
    assert all(s == Standing() for s in judge_run(
        {r: RankWork(t) for r, t in own.items()}).values())


def test_own_work_is_never_negative() -> None:
    step = StepRecord(run="r", rank=0, step=0, duration_s=0.1, phases_s={"comm": 0.101})
    assert own_work_s(step) == 0.0


# --- the verdicts that carry it ------------------------------------------------------------


def verdict(step: StepRecord, standing: Standing) -> Verdict:
    return classify(StepEvidence(step, standing=standing))


@pytest.mark.parametrize(
    ("extra", "culprit", "culprit_primary", "cause_phrase"),
    [
        ({3: {"forward": 0.06}}, 3, Bottleneck.UNKNOWN, "cause: compute"),
        ({1: {"data": 0.06}}, 1, Bottleneck.INPUT, "cause: input"),
    ],
)
def test_flag_the_culprit_and_tell_its_peers_whom_they_wait_on(
    extra: dict[int, dict[str, float]], culprit: int, culprit_primary: Bottleneck,
    cause_phrase: str,
) -> None:
    world = 4 if culprit == 3 else 2
    steps = sync_steps(world, extra=extra)
    standings = judge_run(works(steps))
    verdicts = {s.rank: verdict(s, standings[s.rank]) for s in steps}
    flagged = {r for r, v in verdicts.items() if Flag.STRAGGLER in v.flags}
    assert flagged == {culprit}
    assert verdicts[culprit].primary is culprit_primary
    assert cause_phrase in verdicts[culprit].hint
    assert verdicts[culprit].straggler_cause is standings[culprit].cause
    for rank, v in verdicts.items():
        if rank != culprit:
            assert v.primary is Bottleneck.COMMUNICATION
            assert f"waiting on a slower rank (rank {culprit})" in v.hint
            assert v.slower_rank == culprit and v.straggler_cause is None


def test_the_peers_of_a_silent_rank_are_told_it_stopped_reporting() -> None:
    steps = sync_steps(2)
    step = StepRecord(run="ddp", rank=0, step=9, duration_s=1.0, world=3, t_start=0.0,
                      phases_s={"forward": 0.1, "backward": 0.85},
                      comm=CommStats(0.8, 0.82, ()))
    v = verdict(step, judge_run(works(steps), silent=frozenset({2}))[0])
    assert v.primary is Bottleneck.COMMUNICATION
    assert "waiting on a slower rank (rank 2, which stopped reporting)" in v.hint


# --- a low score is not enough: the extra must matter, and last ------------------------------


def test_a_large_ratio_on_a_small_share_of_the_step_is_not_flagged() -> None:
    """Ranks that mostly wait: 4 ms of own work against 2 ms is a score of 0.5, but removing
    the 2 ms would shorten the 80 ms step by 2.5 %."""
    run = {0: RankWork(0.002, step_s=0.08), 1: RankWork(0.002, step_s=0.08),
           2: RankWork(0.004, step_s=0.08)}
    standings = judge_run(run)
    assert standings[2].score == pytest.approx(0.5)
    assert all(s.cause is None and s.slower_rank is None for s in standings.values())
    # The same ratio on a step it is 10 % of is flagged; the threshold moves it.
    assert judge_run({**run, 2: RankWork(0.004, step_s=0.02)})[2].cause is StragglerCause.UNKNOWN
    strict = replace(DEFAULT, straggler_extra_share_min=0.2)
    assert judge_run({**run, 2: RankWork(0.004, step_s=0.02)}, thresholds=strict)[2].cause is None


def test_a_straggler_must_be_slower_through_its_window() -> None:
    """Medians 1.5x apart, but the slow rank's lower quartile is under its peer's upper one:
    slower on some long steps, not throughout (a host's CPU contention, not more work)."""
    fast = RankWork(0.2, own_low_s=0.16, own_high_s=0.26, step_s=0.5, steps=STRAGGLER_MIN_STEPS)
    slow = RankWork(0.3, own_low_s=0.22, own_high_s=0.4, step_s=0.5, steps=STRAGGLER_MIN_STEPS)
    assert judge_run({0: slow, 1: fast})[0].cause is None
    steady = replace(slow, own_low_s=0.28)
    assert judge_run({0: steady, 1: fast})[0].cause is StragglerCause.UNKNOWN
    # Too few steps yet to say it persists.
    short = replace(steady, steps=STRAGGLER_MIN_STEPS - 1)
    standings = judge_run({0: short, 1: replace(fast, steps=STRAGGLER_MIN_STEPS - 1)})
    assert standings[0].cause is None and standings[1].slower_rank is None
    assert standings[0].score == pytest.approx(0.2 / 0.3)  # the score is still reported


# --- real recordings: a balanced job on a contended host, and a real straggler ---------------

DATA = Path(__file__).resolve().parent / "data"


def replay(name: str) -> tuple[dict[int, list[Verdict]], list[dict[int, float | None]]]:
    """A recording of real DDP ranks (gloo, 2 ranks, recorded by an agent) through the
    agent's engine, a pass as each step arrives: each rank's verdicts, and every pass's scores."""
    records = [decode_record(json.loads(line))
               for line in (DATA / name).read_text().splitlines() if line.strip()]
    steps = sorted((r for r in records if isinstance(r, StepRecord)), key=lambda r: r.t_end or 0.0)
    analyzer = StepAnalyzer(resolution_s=0.5)
    verdicts: dict[int, list[Verdict]] = {}
    scores = []
    for now in [s.t_end or 0.0 for s in steps] + [math.inf]:
        for step in steps:
            if step.t_end == now:
                analyzer.add([step], received_t=now)
        for v in analyzer.process(now, lambda *_: [], [], {}):
            verdicts.setdefault(v.rank, []).extend([v.verdict] * len(v.steps))
        scores.append({a.rank: a.straggler_score for a in analyzer.analyses()})
    return verdicts, scores


def test_a_balanced_job_on_a_contended_host_has_no_straggler() -> None:
    """Two ranks doing the same work (4 x Linear(2048, 2048), batch 2) on a host with far more
    runnable threads than cores. Rank 0's own work ran at 0.30 s a step against rank 1's
    0.22 s, for most of the 40 steps, while their training threads' CPU time per step read
    0.088 s and 0.069 s: its thread waited for a core. The score alone (peers ÷ own) sat
    below 0.75 through most of the run and flagged rank 0 on 35 of its 40 steps."""
    verdicts, scores = replay("ddp_balanced_contended.jsonl")
    rank0 = [s[0] for s in scores if s.get(0) is not None]
    assert sum(score < 0.75 for score in rank0) >= 0.5 * len(rank0)  # what the score alone says
    assert {len(v) for v in verdicts.values()} == {40}
    for rank in (0, 1):
        assert not any(Flag.STRAGGLER in v.flags for v in verdicts[rank])
        assert all(v.slower_rank is None for v in verdicts[rank])


def test_a_real_straggler_is_still_flagged() -> None:
    """Two ranks, rank 1's batches 60 ms late (a sleep in its data loader), 80 steps."""
    verdicts, _ = replay("ddp_slow_input.jsonl")
    flagged = [Flag.STRAGGLER in v.flags for v in verdicts[1]]
    assert sum(flagged) >= 0.8 * len(flagged)
    assert {v.straggler_cause for v in verdicts[1] if Flag.STRAGGLER in v.flags} == {
        StragglerCause.INPUT}
    assert not any(Flag.STRAGGLER in v.flags for v in verdicts[0])
    late = verdicts[0][STRAGGLER_MIN_STEPS:]
    assert sum(v.slower_rank == 1 for v in late) >= 0.9 * len(late)
