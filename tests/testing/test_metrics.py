"""The harness's exposition reading and quantiles, on text whose values are known."""

from __future__ import annotations

import pytest

from gpumon.testing import first, parse_metrics, quantile, series, value, values

EXPOSITION = """\
# HELP gpumon_steps_total Steps seen.
# TYPE gpumon_steps_total counter
gpumon_steps_total{run="a",rank="0"} 12
gpumon_steps_total{run="a",rank="1"} 10
gpumon_steps_total{run="b",rank="0"} 3
# HELP gpumon_step_duration_seconds Step time.
# TYPE gpumon_step_duration_seconds histogram
gpumon_step_duration_seconds_bucket{run="a",rank="0",le="0.1"} 4
gpumon_step_duration_seconds_bucket{run="a",rank="0",le="+Inf"} 12
gpumon_step_duration_seconds_sum{run="a",rank="0"} 2.5
gpumon_step_duration_seconds_count{run="a",rank="0"} 12
# HELP gpumon_nvml_up NVML answers.
# TYPE gpumon_nvml_up gauge
gpumon_nvml_up 0
"""


def test_parse_metrics_keys_samples_by_name_and_labels() -> None:
    metrics = parse_metrics(EXPOSITION)
    assert metrics[("gpumon_steps_total", frozenset({("run", "a"), ("rank", "1")}))] == 10
    assert metrics[("gpumon_nvml_up", frozenset())] == 0
    # Histogram samples keep their own names; the +Inf bucket is a label value like any other.
    assert metrics[("gpumon_step_duration_seconds_bucket",
                    frozenset({("run", "a"), ("rank", "0"), ("le", "+Inf")}))] == 12
    assert len(metrics) == 8


def test_lookups_select_by_label_subset() -> None:
    metrics = parse_metrics(EXPOSITION)
    assert sorted(values(metrics, "gpumon_steps_total", run="a")) == [10, 12]
    assert sorted(values(metrics, "gpumon_steps_total")) == [3, 10, 12]
    assert value(metrics, "gpumon_steps_total", run="b") == 3
    assert sorted(series(metrics, "gpumon_steps_total", rank="0"), key=lambda s: s[1]) == [
        ({"run": "b", "rank": "0"}, 3), ({"run": "a", "rank": "0"}, 12)]
    assert first(metrics, "gpumon_steps_total", run="b") == 3
    assert first(metrics, "gpumon_steps_total", run="c") is None
    assert values(metrics, "gpumon_absent") == []


def test_value_refuses_absent_and_ambiguous_series() -> None:
    metrics = parse_metrics(EXPOSITION)
    with pytest.raises(AssertionError, match="found \\[\\]"):
        value(metrics, "gpumon_steps_total", run="c")
    with pytest.raises(AssertionError, match="expected one series"):
        value(metrics, "gpumon_steps_total", run="a")


def test_parse_metrics_rejects_a_malformed_exposition() -> None:
    with pytest.raises(ValueError):
        parse_metrics('gpumon_steps_total{run="a" 12\n')


def test_quantile_is_nearest_rank_of_real_observations() -> None:
    samples = [float(x) for x in range(1, 101)]  # 1..100, shuffled below
    shuffled = samples[::2] + samples[1::2]
    assert quantile(shuffled, 0.0) == 1
    assert quantile(shuffled, 0.5) == 51
    assert quantile(shuffled, 0.99) == 100
    assert quantile(shuffled, 1.0) == 100
    assert quantile([0.3, 0.1, 0.2], 0.5) == 0.2
    with pytest.raises(ValueError):
        quantile([], 0.5)
