"""Summarising GPU samples over a step's window, and widening short windows."""

from __future__ import annotations

import pytest

from gpumon.analysis.window import group_steps, merge_steps, summarize_gpu_window
from gpumon.collectors.samples import GpuSample
from gpumon.wire import MemoryStats, StepRecord


def sample(t: float, **fields: object) -> GpuSample:
    return GpuSample(index=0, t=t, **fields)  # type: ignore[arg-type]


def test_means_over_samples_inside_the_window_bounds_inclusive() -> None:
    samples = [
        sample(9.9, utilization_ratio=0.0),  # before
        sample(10.0, utilization_ratio=0.5, sm_active_ratio=0.4),
        sample(10.5, utilization_ratio=1.0, sm_active_ratio=0.8),
        sample(11.0, utilization_ratio=0.9),  # on t1: inside
        sample(11.1, utilization_ratio=0.0),  # after
    ]
    window = summarize_gpu_window(samples, 10.0, 11.0)
    assert window is not None
    assert window.sample_count == 3
    assert window.utilization_ratio == pytest.approx(0.8)
    assert window.sm_active_ratio == pytest.approx(0.6)  # mean of the two that had it
    assert window.counts == {"utilization_ratio": 3, "sm_active_ratio": 2}
    assert window.has_gpm


def test_absent_fields_stay_absent() -> None:
    window = summarize_gpu_window([sample(1.0, utilization_ratio=0.7)], 0.0, 2.0)
    assert window is not None
    assert window.tensor_active_ratio is None
    assert window.dram_active_ratio is None
    assert window.nvlink_tx_bytes_per_second is None
    assert window.memory_used_bytes_max is None
    assert not window.has_gpm


def test_driver_buffered_utilization_samples_count_like_polled_ones() -> None:
    polled = sample(1.0, utilization_ratio=0.9, memory_used_bytes=10, memory_total_bytes=100)
    buffered = [sample(1.0 + i / 6, utilization_ratio=0.3) for i in range(1, 6)]
    window = summarize_gpu_window([polled, *buffered], 1.0, 2.0)
    assert window is not None
    assert window.sample_count == 6
    assert window.counts["utilization_ratio"] == 6
    assert window.utilization_ratio == pytest.approx((0.9 + 5 * 0.3) / 6)
    assert window.counts["memory_used_bytes"] == 1


def test_memory_used_is_the_maximum_and_total_the_latest() -> None:
    samples = [
        sample(1.0, memory_used_bytes=50, memory_total_bytes=100),
        sample(2.0, memory_used_bytes=90, memory_total_bytes=100),
        sample(3.0, memory_used_bytes=70),
    ]
    window = summarize_gpu_window(samples, 0.0, 5.0)
    assert window is not None
    assert (window.memory_used_bytes_max, window.memory_total_bytes) == (90, 100)


def test_clock_event_fractions_over_samples_that_report_reasons() -> None:
    samples = [
        sample(1.0, clock_event_reasons={"hw_thermal_slowdown": True, "sw_power_cap": False}),
        sample(2.0, clock_event_reasons={"hw_thermal_slowdown": False, "sw_power_cap": False}),
        sample(3.0, utilization_ratio=0.5),  # driver-buffered: no reasons, not counted
    ]
    window = summarize_gpu_window(samples, 0.0, 5.0)
    assert window is not None
    assert window.clock_event_fractions == {"hw_thermal_slowdown": 0.5, "sw_power_cap": 0.0}


@pytest.mark.parametrize(
    "samples",
    [
        [],
        [sample(5.0, utilization_ratio=1.0)],  # outside
        [GpuSample(index=0, t=1.0, up=False, utilization_ratio=1.0)],  # GPU down
    ],
)
def test_no_usable_samples_gives_none(samples: list[GpuSample]) -> None:
    assert summarize_gpu_window(samples, 0.0, 2.0) is None


def test_samples_of_several_gpus_are_refused() -> None:
    with pytest.raises(ValueError, match="several GPUs"):
        summarize_gpu_window([sample(1.0), GpuSample(index=1, t=1.0)], 0.0, 2.0)


def test_reversed_window_is_refused() -> None:
    with pytest.raises(ValueError):
        summarize_gpu_window([sample(1.0)], 2.0, 1.0)


def step(n: int, t_start: float | None, duration_s: float = 0.1, **kw: object) -> StepRecord:
    return StepRecord(run="r", rank=0, step=n, duration_s=duration_s, t_start=t_start, **kw)  # type: ignore[arg-type]


def test_merge_sums_phases_and_counts_and_spans_the_steps() -> None:
    a = step(1, 100.0, 0.1, phases_s={"data": 0.02, "forward": 0.05}, tokens=10, flops=1e12,
             mem=MemoryStats(peak_bytes=500, alloc_retries=1, ooms=0, reserved_bytes=900))
    b = step(2, 100.12, 0.1, phases_s={"data": 0.01, "backward": 0.06}, tokens=20, flops=2e12,
             mem=MemoryStats(peak_bytes=400, alloc_retries=2, ooms=0, reserved_bytes=1000))
    merged = merge_steps([a, b])
    assert merged.step == 2
    assert merged.t_start == 100.0
    assert merged.duration_s == pytest.approx(0.22)  # the gap is unattributed time
    assert merged.phases_s == pytest.approx({"data": 0.03, "forward": 0.05, "backward": 0.06})
    assert (merged.tokens, merged.flops) == (30, 3e12)
    assert merged.mem == MemoryStats(peak_bytes=500, alloc_retries=2, ooms=0, reserved_bytes=1000)


def test_merge_leaves_partial_counts_unknown_rather_than_understated() -> None:
    merged = merge_steps([step(1, 0.0, tokens=10), step(2, 0.1, tokens=None)])
    assert merged.tokens is None


def test_merge_without_start_times_sums_durations() -> None:
    merged = merge_steps([step(1, None, 0.1), step(2, None, 0.2)])
    assert merged.t_start is None
    assert merged.duration_s == pytest.approx(0.3)


def test_merge_refuses_mixed_ranks_and_empty() -> None:
    with pytest.raises(ValueError):
        merge_steps([])
    other = StepRecord(run="r", rank=1, step=2, duration_s=0.1)
    with pytest.raises(ValueError):
        merge_steps([step(1, 0.0), other])


@pytest.mark.parametrize(
    ("durations", "min_window_s", "expected_groups"),
    [
        ([0.125] * 10, 0.375, [3, 3, 3, 1]),  # last group short: a streaming caller holds it back
        ([1.0] * 3, 0.3, [1, 1, 1]),  # long steps pass through
        ([0.125] * 4, 0.0, [1, 1, 1, 1]),
    ],
)
def test_groups_close_once_the_window_is_wide_enough(
    durations: list[float], min_window_s: float, expected_groups: list[int]
) -> None:
    steps, t = [], 0.0
    for n, d in enumerate(durations, start=1):
        steps.append(step(n, t, d))
        t += d
    merged = [merge_steps(g) for g in group_steps(steps, min_window_s)]
    assert [m.step for m in merged] == list(_cumulative(expected_groups))


def test_a_skipped_step_closes_a_group() -> None:
    steps = [step(1, 0.0), step(2, 0.1), step(4, 0.3), step(5, 0.4)]
    merged = [merge_steps(g) for g in group_steps(steps, 1.0)]
    assert [(m.step, round(m.duration_s, 6)) for m in merged] == [(2, 0.2), (5, 0.2)]


def _cumulative(groups: list[int]) -> list[int]:
    out, total = [], 0
    for g in groups:
        total += g
        out.append(total)
    return out
