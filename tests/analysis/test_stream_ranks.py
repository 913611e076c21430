"""The straggler comparison in the streaming analyzer: steps of a synchronous run in, the slow
rank flagged with its cause, its peers told whom they wait on; a rank that goes silent, a
world size that changes mid-run and impossible comm figures handled without a crash."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

from gpumon.analysis.bottleneck import Bottleneck, Flag
from gpumon.analysis.straggler import STRAGGLER_MIN_STEPS, SlowerRank, StragglerCause
from gpumon.analysis.stream import StepAnalyzer, StepVerdict
from gpumon.analysis.thresholds import DEFAULT
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.wire import CollectiveOp, CommStats, ParallelLayout, StepRecord

T0 = 1000.0
STEP_S = 0.25
GPUS = [GpuStatic(index=i, uuid=f"GPU-{i}", name="NVIDIA H100 80GB HBM3", pci_bus_id="",
                  memory_total_bytes=80 * 1024**3) for i in range(4)]


def make_history(clock_hz: Mapping[int, float] | None = None,
                 throttled: frozenset[int] = frozenset()):  # type: ignore[no-untyped-def]
    """Every GPU busy (GPM present) over the whole test, sampled every 0.1 s."""
    clocks = clock_hz or {}

    def history(index: int, t0: float, t1: float) -> list[GpuSample]:
        k0, k1 = int(t0 * 10) + 1, int(t1 * 10)
        return [GpuSample(index=index, t=k / 10, utilization_ratio=1.0, sm_active_ratio=0.9,
                          tensor_active_ratio=0.6, dram_active_ratio=0.3,
                          sm_clock_hz=clocks.get(index, 1.98e9),
                          clock_event_reasons={"hw_thermal_slowdown": index in throttled})
                for k in range(k0, k1 + 1)]
    return history


def sync_run(world: int, steps: range, *, extra_forward: Mapping[int, float] | None = None,
             extra_data: Mapping[int, float] | None = None, ranks: range | None = None,
             run: str = "ddp", t0: float = T0) -> list[StepRecord]:
    """Synchronous DDP steps: a rank's wait for the slowest sits inside its backward phase and
    in its measured ``comm``; every rank's step lasts the same."""
    extra_forward, extra_data = extra_forward or {}, extra_data or {}
    base = {"data": 0.005, "forward": 0.06, "backward": 0.1}
    tail, optimizer = 0.02, 0.01
    ready = {r: sum(base.values()) + extra_forward.get(r, 0.0) + extra_data.get(r, 0.0)
             for r in range(world)}
    duration = max(ready.values()) + tail + optimizer
    out = []
    for n in steps:
        start = t0 + n * duration
        for rank in ranks if ranks is not None else range(world):
            exposed = max(ready.values()) + tail - ready[rank]
            out.append(StepRecord(
                run=run, rank=rank, step=n, duration_s=duration, world=world, t_start=start,
                gpu=f"GPU-{rank % 4}",
                phases_s={"data": base["data"] + extra_data.get(rank, 0.0),
                          "forward": base["forward"] + extra_forward.get(rank, 0.0),
                          "backward": base["backward"] + exposed, "optimizer": optimizer},
                comm=CommStats(exposed, exposed + 0.05,
                               (CollectiveOp("all_reduce", 4, 64 * 2**20, exposed + 0.05),))))
    return out


def feed(analyzer: StepAnalyzer, steps: list[StepRecord], history=None,  # type: ignore[no-untyped-def]
         xid_gpus: frozenset[int] = frozenset(),
         layouts: Mapping[tuple[str, int], ParallelLayout] | None = None) -> list[StepVerdict]:
    """Hand the analyzer every step as a live agent would (in order, a pass per second)."""
    history = history or make_history()
    verdicts: list[StepVerdict] = []
    by_end = sorted(steps, key=lambda s: s.t_end or 0.0)
    now = by_end[0].t_end or 0.0
    i = 0
    while i < len(by_end):
        now += 1.0
        batch = [s for s in by_end[i:] if (s.t_end or 0.0) <= now]
        i += len(batch)
        analyzer.add(batch, received_t=now)
        for part in analyzer.process_in_slices(now, history, GPUS, {}, xid_gpus=xid_gpus,
                                               layouts=layouts):
            verdicts += part
    for part in analyzer.process_in_slices(now + 60, history, GPUS, {}, xid_gpus=xid_gpus,
                                           layouts=layouts):
        verdicts += part
    return verdicts


def flagged_share(verdicts: list[StepVerdict], rank: int) -> float:
    """Share of the rank's verdicts flagged, once a comparison could flag it: its first
    ``STRAGGLER_MIN_STEPS`` steps, and the pass (up to 8 steps here) after them, cannot be."""
    mine = [v for v in verdicts if v.rank == rank and min(v.steps) >= STRAGGLER_MIN_STEPS + 8]
    return sum(Flag.STRAGGLER in v.verdict.flags for v in mine) / len(mine)


def test_four_ranks_one_with_more_forward_work() -> None:
    analyzer = StepAnalyzer(resolution_s=0.5)
    verdicts = feed(analyzer, sync_run(4, range(120), extra_forward={3: 0.06}))
    assert flagged_share(verdicts, 3) >= 0.95
    assert all(flagged_share(verdicts, r) == 0.0 for r in range(3))
    analyses = {a.rank: a for a in analyzer.analyses()}
    assert analyses[3].straggler_cause is StragglerCause.COMPUTE
    for rank in range(3):
        assert analyses[rank].slower_rank == SlowerRank(3)
        latest = analyses[rank].verdict
        assert latest is not None and latest.primary is Bottleneck.COMMUNICATION
        assert "waiting on a slower rank (rank 3)" in latest.hint


def test_two_ranks_one_starved_by_its_input() -> None:
    analyzer = StepAnalyzer(resolution_s=0.5)
    verdicts = feed(analyzer, sync_run(2, range(80), extra_data={1: 0.06}))
    assert flagged_share(verdicts, 1) >= 0.95 and flagged_share(verdicts, 0) == 0.0
    late = Counter((v.rank, v.verdict.primary) for v in verdicts[10:])
    assert late[(1, Bottleneck.INPUT)] == sum(n for (r, _), n in late.items() if r == 1)
    assert late[(0, Bottleneck.COMMUNICATION)] == sum(n for (r, _), n in late.items() if r == 0)
    assert {a.rank: a.straggler_cause for a in analyzer.analyses()} == {
        0: None, 1: StragglerCause.INPUT}


def test_a_straggler_on_a_throttled_or_erroring_gpu_has_its_gpu_as_cause() -> None:
    for history, xid in ((make_history(throttled=frozenset({2})), frozenset()),
                         (make_history(clock_hz={2: 1.4e9}), frozenset()),
                         (make_history(), frozenset({2}))):
        analyzer = StepAnalyzer(resolution_s=0.5)
        feed(analyzer, sync_run(4, range(40), extra_forward={2: 0.06}), history, xid)
        causes = {a.rank: a.straggler_cause for a in analyzer.analyses()}
        assert causes == {0: None, 1: None, 2: StragglerCause.GPU, 3: None}


def test_balanced_ranks_are_never_flagged() -> None:
    analyzer = StepAnalyzer(resolution_s=0.5)
    verdicts = feed(analyzer, sync_run(8, range(40)))
    assert not any(Flag.STRAGGLER in v.verdict.flags for v in verdicts)
    assert {a.slower_rank for a in analyzer.analyses()} == {None}


def test_a_rank_that_stops_reporting_is_left_out_and_named() -> None:
    """Rank 3's records stop (its client lost its socket) while ranks 0-2 keep stepping and
    waiting: its last figures must not be compared, and its peers hear that it went quiet."""
    steps = [s for s in sync_run(4, range(120), extra_forward={3: 0.06})
             if s.rank != 3 or s.step < 40]
    analyzer = StepAnalyzer(resolution_s=0.5)
    feed(analyzer, steps)
    analyses = {a.rank: a for a in analyzer.analyses()}
    assert analyses[3].straggler_score is None and analyses[3].straggler_cause is None
    for rank in range(3):
        assert analyses[rank].slower_rank == SlowerRank(3, silent=True)
        latest = analyses[rank].verdict
        assert latest is not None
        assert "rank 3, which stopped reporting" in latest.hint
        assert Flag.STRAGGLER not in latest.flags


def test_a_world_size_change_restarts_the_comparison() -> None:
    """An elastic job restarts from 4 ranks to 2: ranks 2-3 of the old world are not compared
    (nor called silent), ranks 0-1 count one change each and start afresh."""
    before = sync_run(4, range(30), extra_forward={3: 0.06})
    t_restart = max(s.t_end or 0.0 for s in before) + 2.0
    after = sync_run(2, range(30), extra_forward={1: 0.06}, t0=t_restart)
    analyzer = StepAnalyzer(resolution_s=0.5)
    verdicts = feed(analyzer, before + after)
    analyses = {a.rank: a for a in analyzer.analyses()}
    assert {r: a.world_changes for r, a in analyses.items()} == {0: 1, 1: 1, 2: 0, 3: 0}
    assert analyses[1].straggler_cause is StragglerCause.COMPUTE
    assert analyses[0].slower_rank == SlowerRank(1)
    assert analyses[2].straggler_score is None and analyses[3].straggler_score is None
    assert len(verdicts) > 0


def test_impossible_comm_figures_give_verdicts_not_errors() -> None:
    """Records built in-process (not decoded, so unchecked): a wait longer than the step, a
    negative one, NaN. The wire decoder drops these as ``bad_comm``; the analysis must still
    not raise on them."""
    steps = sync_run(2, range(12))
    odd = [
        StepRecord(run="ddp", rank=0, step=20, duration_s=0.1, world=2, t_start=T0 + 10,
                   comm=CommStats(5.0, 5.0)),
        StepRecord(run="ddp", rank=0, step=21, duration_s=0.1, world=2, t_start=T0 + 10.1,
                   phases_s={"forward": 0.05}, comm=CommStats(-1.0, float("nan"))),
        StepRecord(run="ddp", rank=0, step=22, duration_s=0.1, world=2, t_start=T0 + 10.2,
                   phases_s={"comm": float("nan")}, comm=CommStats(float("nan"), 0.0)),
    ]
    verdicts = feed(StepAnalyzer(resolution_s=0.5), steps + odd)
    assert {n for v in verdicts for n in v.steps if v.rank == 0} >= {20, 21, 22}
    for v in verdicts:
        assert 0.0 <= v.verdict.confidence <= 1.0
        assert all(0.0 <= share <= 1.0 for share in v.verdict.fractions.values())


def test_ranks_drifting_apart_for_a_step_are_no_communication_wall() -> None:
    # Two balanced ranks; now and then one is preempted for 60 ms of one step, and its peer
    # waits that long in the all-reduce (a genuine wait, 30 % of that step): a wall it hits in
    # one window of eight, not the job's. When the waits persist, they are its wall.
    def drifting(every: int, by_turns: bool) -> list[StepRecord]:
        out: list[StepRecord] = []
        t = T0
        for n in range(64):
            late = {(n // every) % 2 if by_turns else 0: 0.06} if n % every == 0 else {}
            out += [replace(s, step=n) for s in sync_run(2, range(1), extra_forward=late, t0=t)]
            t += out[-1].duration_s
        return out

    def after_first_window(verdicts: list[StepVerdict], rank: int) -> list[StepVerdict]:
        # A rank's first window has no typical share yet to be weighed against.
        return [v for v in verdicts if v.rank == rank][1:]

    analyzer = StepAnalyzer(resolution_s=0.2)
    verdicts = feed(analyzer, drifting(every=4, by_turns=True))  # one rank late, then the other
    for rank in (0, 1):
        mine = after_first_window(verdicts, rank)
        # the waits are there, and reported as measured
        assert any(v.verdict.fractions["comm"] >= DEFAULT.comm_high_fraction for v in mine)
        assert all(v.verdict.primary is not Bottleneck.COMMUNICATION for v in mine)

    analyzer = StepAnalyzer(resolution_s=0.2)
    verdicts = feed(analyzer, drifting(every=1, by_turns=False))  # rank 0 late on every step
    peer = after_first_window(verdicts, 1)
    assert all(v.verdict.primary is Bottleneck.COMMUNICATION for v in peer)


def test_steps_replayed_after_an_agent_restart_land_in_their_windows_and_judge_no_rank() -> None:
    """Both ranks' steps of a 10 s outage reach the agent at once when it is back (the hooks'
    backlogs), with their own timestamps: every step gets its verdict once, over its own
    window; neither rank looks faster, slower or silent for it."""
    steps = sync_run(2, range(120))
    outage = (T0 + 10.0, T0 + 20.0)
    analyzer = StepAnalyzer(resolution_s=0.5)
    history = make_history()
    verdicts: list[StepVerdict] = []
    now, pending = T0, sorted(steps, key=lambda s: s.t_end or 0.0)
    while pending:
        now += 1.0
        if outage[0] < now <= outage[1]:
            continue  # no agent: nothing arrives, nothing is judged
        batch = [s for s in pending if (s.t_end or 0.0) <= now]
        pending = pending[len(batch):]
        analyzer.add(batch, received_t=now)
        for part in analyzer.process_in_slices(now, history, GPUS, {}):
            verdicts += part
    for part in analyzer.process_in_slices(now + 60, history, GPUS, {}):
        verdicts += part
    for rank in (0, 1):
        judged = sorted(n for v in verdicts if v.rank == rank for n in v.steps)
        assert judged == list(range(120))
    assert not any(Flag.STRAGGLER in v.verdict.flags for v in verdicts)
    assert {a.slower_rank for a in analyzer.analyses()} == {None}
    assert all(a.straggler_score is None or 0.9 < a.straggler_score < 1.1
               for a in analyzer.analyses())


# --- ranks compared with the ranks that do the same work ------------------------------------


def pipeline_layouts(run: str = "ddp", *, stages: int = 2,
                     replicas: int = 2) -> dict[tuple[str, int], ParallelLayout]:
    """Ranks laid out as ``replicas`` data-parallel copies of a ``stages``-stage pipeline."""
    return {(run, stage * replicas + dp): ParallelLayout(dp=dp, pp=stage, source="argument")
            for stage in range(stages) for dp in range(replicas)}


def test_pipeline_stages_doing_different_work_by_design_are_not_stragglers() -> None:
    """Stage 1 (ranks 2 and 3) has 0.2 s more forward work a step than stage 0: without the
    layout one of its ranks reads as the run's straggler; with it, each rank is compared with
    its replica only and none is."""
    steps = sync_run(4, range(40), extra_forward={2: 0.2, 3: 0.2})
    blind = StepAnalyzer(resolution_s=0.5)
    feed(blind, steps)
    assert any(a.straggler_cause is not None for a in blind.analyses())

    laid_out = StepAnalyzer(resolution_s=0.5)
    feed(laid_out, steps, layouts=pipeline_layouts())
    analyses = {a.rank: a for a in laid_out.analyses()}
    assert all(a.straggler_cause is None and a.slower_rank is None for a in analyses.values())
    assert all(abs((a.straggler_score or 0.0) - 1.0) < 0.01 for a in analyses.values())
    assert analyses[2].parallel == ParallelLayout(dp=0, pp=1, source="argument")
    assert analyses[2].own_work_s is not None and analyses[0].own_work_s is not None
    assert analyses[2].own_work_s - analyses[0].own_work_s > 0.19


def test_a_slow_replica_is_flagged_against_its_own_stage() -> None:
    steps = sync_run(4, range(40), extra_forward={2: 0.2, 3: 0.4})
    analyzer = StepAnalyzer(resolution_s=0.5)
    feed(analyzer, steps, layouts=pipeline_layouts())
    analyses = {a.rank: a for a in analyzer.analyses()}
    assert analyses[3].straggler_cause is StragglerCause.COMPUTE
    assert analyses[2].slower_rank == SlowerRank(3)
    assert analyses[0].straggler_cause is None and analyses[0].slower_rank is None


def test_a_rank_without_a_replica_has_no_score_rather_than_a_wrong_one() -> None:
    steps = sync_run(2, range(30), extra_forward={1: 0.1})
    analyzer = StepAnalyzer(resolution_s=0.5)
    feed(analyzer, steps, layouts=pipeline_layouts(stages=2, replicas=1))
    assert all(a.straggler_score is None and a.straggler_cause is None
               for a in analyzer.analyses())


def test_ranks_of_unknown_layout_are_compared_among_themselves_as_before() -> None:
    """Ranks 0 and 1 said where they are (one stage each); ranks 2 and 3 did not, and are
    compared with each other as any two ranks of a run are."""
    steps = sync_run(4, range(40), extra_forward={3: 0.1})
    layouts = {("ddp", 0): ParallelLayout(pp=0), ("ddp", 1): ParallelLayout(pp=1)}
    analyzer = StepAnalyzer(resolution_s=0.5)
    feed(analyzer, steps, layouts=layouts)
    analyses = {a.rank: a for a in analyzer.analyses()}
    assert analyses[3].straggler_cause is StragglerCause.COMPUTE
    assert analyses[3].parallel is None
    assert analyses[0].straggler_score is None
