"""Live OOM risk: headroom, trend, prediction and the composite ratio."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.analysis.oom import HIGH_RISK, assess_oom_risk, theil_sen

GB = 10**9
CAP = 80 * GB


def assess(peaks: list[tuple[float, int]], **kw: Any) -> Any:
    args: dict[str, Any] = {
        "capacity_bytes": CAP, "nvml_used_bytes": None, "reserved_bytes": None,
        "allocated_bytes": None, "alloc_retries_delta": 0, "ooms_delta": 0,
        "step_period_s": 1.0,
    }
    args.update(kw)
    return assess_oom_risk(peaks, **args)


T0 = 1.7e9  # unix-second magnitudes must not cost precision


def steady(level: int, n: int = 30) -> list[tuple[float, int]]:
    return [(T0 + i, level) for i in range(n)]


def test_steady_peaks_are_low_risk_with_no_prediction() -> None:
    risk = assess(steady(40 * GB), reserved_bytes=42 * GB, nvml_used_bytes=43 * GB)
    assert risk.predicted_seconds is None and risk.predicted_steps is None
    assert risk.peak_trend_bytes_per_second == 0
    assert risk.risk_ratio == 0.0
    assert risk.headroom_bytes == 37 * GB
    assert risk.reasons == ()


@pytest.mark.parametrize("slope", [10 * 10**6, 50 * 10**6, 200 * 10**6])
def test_linear_growth_predicts_time_to_capacity(slope: int) -> None:
    peaks = [(T0 + 2.0 * i, 20 * GB + slope * 2 * i) for i in range(30)]
    risk = assess(peaks, step_period_s=2.0)
    last = peaks[-1][1]
    assert risk.peak_trend_bytes_per_second == pytest.approx(slope)
    assert risk.predicted_seconds == pytest.approx((CAP - last) / slope)
    assert risk.predicted_steps == pytest.approx(risk.predicted_seconds / 2.0)


def test_prediction_counts_memory_others_hold() -> None:
    # NVML sees 3 GB beyond torch's reservation (CUDA context, another process): the peaks
    # can only grow into what is left.
    peaks = [(T0 + i, 20 * GB + 10**8 * i) for i in range(30)]
    risk = assess(peaks, reserved_bytes=25 * GB, nvml_used_bytes=28 * GB)
    assert risk.predicted_seconds == pytest.approx((CAP - 3 * GB - peaks[-1][1]) / 10**8)


@pytest.mark.parametrize("spike_at", [0, 10, 29])
def test_a_single_spike_does_not_make_a_trend(spike_at: int) -> None:
    peaks = steady(40 * GB)
    peaks[spike_at] = (peaks[spike_at][0], 79 * GB)
    risk = assess(peaks)
    assert risk.peak_trend_bytes_per_second == 0
    assert risk.predicted_seconds is None


def test_too_few_points_make_no_trend() -> None:
    risk = assess([(T0, 1 * GB), (T0 + 1, 2 * GB), (T0 + 2, 3 * GB), (T0 + 3, 4 * GB)])
    assert risk.peak_trend_bytes_per_second is None and risk.predicted_seconds is None


def test_shrinking_peaks_predict_nothing() -> None:
    risk = assess([(T0 + i, 60 * GB - 10**8 * i) for i in range(30)])
    assert risk.predicted_seconds is None


def test_freed_memory_starts_the_trend_again() -> None:
    # 25 s of growth to 75 GB, then the job frees it: the growth before the fall must not
    # keep predicting an OOM for an almost empty GPU.
    growth = [(T0 + i, 50 * GB + GB * i) for i in range(25)]
    freed = [(T0 + 25 + i, 2 * GB) for i in range(7)]
    risk = assess(growth + freed, nvml_used_bytes=3 * GB, reserved_bytes=2 * GB)
    assert risk.predicted_seconds is None
    assert risk.peak_trend_bytes_per_second == 0
    assert risk.risk_ratio == 0.0
    # Right after the fall there are too few points for a trend at all.
    risk = assess(growth + freed[:2], nvml_used_bytes=3 * GB, reserved_bytes=2 * GB)
    assert risk.peak_trend_bytes_per_second is None and risk.risk_ratio == 0.0


def test_growth_after_a_fall_is_a_trend_of_its_own() -> None:
    growth = [(T0 + i, 50 * GB + GB * i) for i in range(20)]
    regrowth = [(T0 + 20 + i, 10 * GB + 10**8 * i) for i in range(12)]
    risk = assess(growth + regrowth)
    assert risk.peak_trend_bytes_per_second == pytest.approx(10**8)


def test_an_oom_is_certain_risk() -> None:
    risk = assess(steady(10 * GB), ooms_delta=1)
    assert risk.risk_ratio == 1.0
    assert any("out-of-memory" in r for r in risk.reasons)


@pytest.mark.parametrize(
    ("used_gb", "low", "high"),
    [
        (40, 0.0, 0.0),
        (60, 0.0, 0.0),  # 75%: still free
        (66, 0.3, 0.5),
        (72, HIGH_RISK, HIGH_RISK),  # 90% used, headroom 10%: high
        (76, 0.85, 0.95),
        (80, 1.0, 1.0),
    ],
)
def test_headroom_term(used_gb: int, low: float, high: float) -> None:
    risk = assess(steady(10 * GB), nvml_used_bytes=used_gb * GB)
    assert low - 1e-9 <= risk.risk_ratio <= high + 1e-9


def test_headroom_uses_the_larger_of_nvml_and_reserved() -> None:
    assert assess([], nvml_used_bytes=50 * GB, reserved_bytes=60 * GB).headroom_bytes == 20 * GB
    assert assess([], nvml_used_bytes=65 * GB, reserved_bytes=60 * GB).headroom_bytes == 15 * GB
    assert assess(steady(30 * GB)).headroom_bytes == 50 * GB  # last peak when nothing else
    assert assess([]).headroom_bytes is None


@pytest.mark.parametrize(
    ("seconds_to_oom", "low", "high"),
    [
        (0.0, 1.0, 1.0),
        (300.0, 0.85, 0.95),  # inside the 600 s horizon: high
        (600.0, HIGH_RISK, HIGH_RISK),
        (1200.0, 0.35, 0.45),  # a slow climb is a small risk, not none
        (60_000.0, 0.0, 0.01),
    ],
)
def test_trend_term(seconds_to_oom: float, low: float, high: float) -> None:
    # The last peak sits at 25% of capacity, where the headroom term is still 0.
    last = CAP // 4 if seconds_to_oom else CAP
    slope = int((CAP - last) / seconds_to_oom) if seconds_to_oom else 10**7
    peaks = [(T0 + i, last - slope * (29 - i)) for i in range(30)]
    risk = assess(peaks)
    assert risk.predicted_seconds == pytest.approx(seconds_to_oom, abs=1e-3)
    assert low - 1e-9 <= risk.risk_ratio <= high + 1e-9


def test_retries_raise_the_risk() -> None:
    calm = assess(steady(10 * GB), nvml_used_bytes=66 * GB)
    retried = assess(steady(10 * GB), nvml_used_bytes=66 * GB, alloc_retries_delta=3)
    assert retried.risk_ratio == pytest.approx(calm.risk_ratio + (1 - calm.risk_ratio) * 0.5)
    assert assess(steady(10 * GB), alloc_retries_delta=1).risk_ratio == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("allocated", "reserved", "expected"),
    [(30 * GB, 40 * GB, 0.25), (40 * GB, 40 * GB, 0.0), (None, 40 * GB, None),
     (10 * GB, None, None), (0, 0, None)],
)
def test_fragmentation(allocated: int | None, reserved: int | None,
                       expected: float | None) -> None:
    risk = assess([], allocated_bytes=allocated, reserved_bytes=reserved)
    assert risk.fragmentation_ratio == (pytest.approx(expected) if expected is not None else None)


def test_invalid_capacity_is_refused() -> None:
    with pytest.raises(ValueError):
        assess([], capacity_bytes=0)


def test_theil_sen_fits_a_line_and_ignores_an_outlier() -> None:
    points = [(float(t), 3.0 * t + 1.0) for t in range(10)]
    points[4] = (4.0, 1000.0)
    line = theil_sen(points)
    assert line is not None
    assert line == pytest.approx((3.0, 1.0))
    assert theil_sen([(1.0, 5.0), (1.0, 6.0)]) is None


@settings(max_examples=200, deadline=None)
@given(
    peaks=st.lists(st.tuples(st.floats(0, 1e6), st.integers(0, 2 * CAP)), max_size=40),
    used=st.none() | st.integers(0, CAP),
    reserved=st.none() | st.integers(0, CAP),
    allocated=st.none() | st.integers(0, CAP),
    retries=st.integers(0, 100),
    ooms=st.integers(0, 3),
    period=st.none() | st.floats(0.0, 100.0),
)
def test_risk_is_always_a_ratio(
    peaks: list[tuple[float, int]], used: int | None, reserved: int | None,
    allocated: int | None, retries: int, ooms: int, period: float | None,
) -> None:
    risk = assess(peaks, nvml_used_bytes=used, reserved_bytes=reserved,
                  allocated_bytes=allocated, alloc_retries_delta=retries, ooms_delta=ooms,
                  step_period_s=period)
    assert 0.0 <= risk.risk_ratio <= 1.0
    assert risk.predicted_seconds is None or risk.predicted_seconds >= 0
    assert risk.fragmentation_ratio is None or 0.0 <= risk.fragmentation_ratio <= 1.0
