"""The streaming verdict engine: windows, grouping, clock skew, attribution."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpumon.analysis.bottleneck import Flag
from gpumon.analysis.straggler import STRAGGLER_MIN_STEPS
from gpumon.analysis.stream import (
    MAX_PENDING,
    RankAnalysis,
    StepAnalyzer,
    StepVerdict,
    attribute_gpu,
)
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.wire import CommStats, StepRecord

H100 = GpuStatic(index=0, uuid="GPU-a", name="NVIDIA H100 80GB HBM3", pci_bus_id="",
                 memory_total_bytes=80 * 1024**3)


def busy_samples(t0: float, t1: float) -> list[GpuSample]:
    return [GpuSample(index=0, t=t0 + k * 0.25, utilization_ratio=0.95, sm_active_ratio=0.93,
                      tensor_active_ratio=0.7, dram_active_ratio=0.3)
            for k in range(int((t1 - t0) / 0.25) + 1)]


def history(index: int, t0: float, t1: float) -> list[GpuSample]:
    return [s for s in busy_samples(0.0, 100.0) if t0 <= s.t <= t1]


def step(n: int, t0: float, duration: float = 0.1, **extra: object) -> StepRecord:
    return StepRecord(run="r", rank=0, step=n, duration_s=duration, t_start=t0, gpu="GPU-a",
                      phases_s={"forward": duration * 0.4, "backward": duration * 0.5},
                      **extra)  # type: ignore[arg-type]


def test_short_steps_are_merged_until_they_span_the_resolution() -> None:
    analyzer = StepAnalyzer(resolution_s=1.0)
    analyzer.add([step(n, 10.0 + n * 0.1) for n in range(30)], received_t=13.0)
    verdicts = analyzer.process(20.0, history, [H100], {})
    assert [len(v.steps) for v in verdicts] == [10, 10, 10]
    assert sum(len(v.steps) for v in verdicts) == 30
    assert all(v.verdict.primary.value == "compute" for v in verdicts)


def test_steps_wait_for_their_gpu_samples() -> None:
    analyzer = StepAnalyzer(resolution_s=1.0)
    analyzer.add([step(n, 10.0 + n * 0.5, duration=0.5) for n in range(4)], received_t=12.0)
    assert analyzer.process(12.0, history, [H100], {}) == []  # too fresh: samples may lag
    assert sum(len(v.steps) for v in analyzer.process(14.0, history, [H100], {})) == 4


def test_a_client_clock_far_ahead_is_rebased_on_receipt() -> None:
    analyzer = StepAnalyzer(resolution_s=1.0)
    analyzer.add([step(0, 10_000.0, duration=1.0)], received_t=50.0)  # "ends" 10,000 s later
    verdicts = analyzer.process(52.0, history, [H100], {})
    assert [v.steps for v in verdicts] == [(0,)]


def test_a_rank_waiting_too_long_keeps_its_newest_steps() -> None:
    analyzer = StepAnalyzer(resolution_s=1.0)
    steps = [step(n, 10.0 + n * 0.01, duration=0.01) for n in range(MAX_PENDING + 300)]
    analyzer.add(steps[:7], received_t=60.0)
    analyzer.add(steps[7:MAX_PENDING + 250], received_t=60.0)  # overflows within one call
    for k in range(MAX_PENDING + 250, len(steps), 5):
        analyzer.add(steps[k:k + 5], received_t=60.0)
    verdicts = analyzer.process(1e4, history, [H100], {})
    assert [n for v in verdicts for n in v.steps] == list(range(300, MAX_PENDING + 300))


def test_gpu_attribution_prefers_uuid_then_process_list_then_index() -> None:
    other = GpuStatic(index=1, uuid="GPU-b", name="x", pci_bus_id="")
    latest = {1: GpuSample(index=1, t=0.0, process_memory_bytes={4242: 1})}
    assert attribute_gpu("GPU-b", None, [H100, other], {}) == 1
    assert attribute_gpu(None, 4242, [H100, other], latest) == 1
    assert attribute_gpu(0, None, [H100, other], {}) == 0
    assert attribute_gpu(7, None, [H100, other], {}) is None
    assert attribute_gpu("GPU-zzz", None, [H100, other], {}) is None


def fleet_steps(runs: int, ranks: int, steps: range, slow_rank: int) -> list[StepRecord]:
    """0.5 s synchronous steps of every rank of ``runs`` runs. From step 6 on, all but
    ``slow_rank`` work twice as fast (0.225 s instead of 0.45 s) and wait the difference in
    the all-reduce: it becomes the straggler."""
    out = []
    for n in steps:
        for run in range(runs):
            for rank in range(ranks):
                own = 0.45 if rank == slow_rank or n < 6 else 0.225
                exposed = 0.5 - own
                out.append(StepRecord(run=f"run{run}", rank=rank, step=n, duration_s=0.5,
                                      t_start=10.0 + n * 0.5, gpu="GPU-a",
                                      phases_s={"forward": 0.15, "backward": 0.3},
                                      comm=CommStats(exposed, exposed + 0.1)))
    return out


def test_a_pass_in_slices_reaches_the_verdicts_and_scores_of_one_pass() -> None:
    # Enough passes (2 steps each) for the straggler's window to persist and flag it.
    passes = STRAGGLER_MIN_STEPS // 2 + 2
    whole, sliced = StepAnalyzer(resolution_s=1.0), StepAnalyzer(resolution_s=1.0)
    for analyzer in (whole, sliced):
        analyzer.add(fleet_steps(2, 32, range(2), slow_rank=31), received_t=11.0)
    verdicts: dict[str, list[StepVerdict]] = {"whole": [], "sliced": []}
    slices = 0
    for second in range(1, passes + 1):
        # Steps 2s-2 and 2s-1 are ready (ended by 10 + s); the next ones, which a live agent
        # lets in between slices while other threads read, are not.
        now = 11.5 + second
        following = fleet_steps(2, 32, range(2 * second, 2 * second + 2), slow_rank=31)
        verdicts["whole"] += whole.process(now, history, [H100], {})
        whole.add(following, received_t=now)
        for part in sliced.process_in_slices(now, history, [H100], {}):
            slices += 1
            verdicts["sliced"] += part
            assert len(sliced.analyses()) == 64
            sliced.add(following[:16], received_t=now)
            following = following[16:]
        sliced.add(following, received_t=now)
    assert slices >= passes * 8  # 64 verdicts a pass, at most 8 a slice
    assert len(verdicts["whole"]) == passes * 64
    assert verdicts["sliced"] == verdicts["whole"]
    assert sliced.analyses() == whole.analyses()
    scores = {(a.run, a.rank): a.straggler_score for a in whole.analyses()}
    # against its own run's other ranks
    assert scores[("run0", 31)] == scores[("run1", 31)] == pytest.approx(0.5)
    assert scores[("run0", 30)] == pytest.approx((30 * 0.225 + 0.45) / 31 / 0.225)
    assert any(Flag.STRAGGLER in v.verdict.flags for v in verdicts["sliced"])


def test_thresholds_reloaded_between_slices_apply_from_the_next_pass() -> None:
    analyzer = StepAnalyzer(resolution_s=1.0)
    analyzer.add(fleet_steps(1, 32, range(4), slow_rank=-1), received_t=12.0)
    parts = analyzer.process_in_slices(20.0, history, [H100], {})
    first = next(parts)
    analyzer.thresholds = replace(analyzer.thresholds, compute_sm_min=0.99, compute_mfu_min=0.99)
    rest = [v for part in parts for v in part]
    assert len(first) + len(rest) == 32 * 2
    assert {v.verdict.primary.value for v in first + rest} == {"compute"}
    analyzer.add(fleet_steps(1, 32, range(4, 6), slow_rank=-1), received_t=14.0)
    after = analyzer.process(22.0, history, [H100], {})
    assert len(after) == 32
    assert "compute" not in {v.verdict.primary.value for v in after}


def test_an_analysis_gets_a_new_version_whenever_it_changes() -> None:
    # Renderers reuse their text for a version they have seen. The case to catch: a rank
    # with no new steps whose straggler score moves because its peers' times did.
    analyzer = StepAnalyzer(resolution_s=1.0)
    seen: dict[int, RankAnalysis] = {}
    score_only = 0
    for n in range(12):
        ranks = range(4) if n < 6 else range(3)  # rank 3 stops; the others slow down
        analyzer.add([replace(step(n, 10.0 + n, duration=1.0 + n * 0.2 * (rank != 3)),
                              rank=rank) for rank in ranks], received_t=10.0 + n + 1)
        analyzer.process(12.0 + n, history, [H100], {})
        for analysis in analyzer.analyses():
            before = seen.get(analysis.rank)
            if before is not None and analysis != before:
                assert analysis.version != before.version, (n, analysis.rank)
                score_only += replace(analysis, straggler_score=before.straggler_score) == before
            seen[analysis.rank] = analysis
    assert score_only >= 1 and seen[3].verdict_step == 5


def test_a_renewed_analysis_is_the_one_replace_makes() -> None:
    """``tracker.renewed`` copies values where ``dataclasses.replace`` calls ``__init__``: the
    same fields (the version too, which equality leaves out), and the same error for a name
    that is no field."""
    from types import MappingProxyType

    from gpumon.analysis.tracker import RankAnalysis, renewed

    old = RankAnalysis(run="r", rank=3, gpu=1, bottleneck_steps=MappingProxyType({"compute": 2}),
                       straggler_score=1.5, version=7)
    changes = {"gpu": 2, "verdict_step": 9, "own_work_s": 0.25, "version": 8}
    new, expected = renewed(old, **changes), replace(old, **changes)
    assert type(new) is RankAnalysis and vars(new) == vars(expected) and new.version == 8
    assert vars(old)["gpu"] == 1 and old.version == 7  # the old one is left as it was
    with pytest.raises(TypeError):
        renewed(old, no_such_field=1)
