"""Live out-of-memory risk of one rank's GPU, from its recent per-step memory peaks.

Pure: the caller keeps the bounded history of ``(t, peak_bytes)`` pairs and the allocator
counters' deltas, and passes them in.

The composite risk (0–1; ≥ ``HIGH_RISK`` is "high"):

* an OOM since the last assessment ⇒ 1.0;
* ``headroom`` term, from the used share u = 1 − headroom/capacity: 0 up to u = 0.75, rising
  linearly to ``HIGH_RISK`` at u = 0.90 (headroom < 10% is high, docs/architecture.md §8) and on to 1.0 at
  u = 1;
* ``trend`` term, from the predicted time T until the peak reaches capacity: ``HIGH_RISK`` at
  T = horizon, rising linearly to 1.0 at T = 0, and ``HIGH_RISK × horizon / T`` beyond the
  horizon (a slow climb is a small risk, not none); 0 when peaks are not growing;
* risk = max(headroom, trend), then allocator retries (cudaMalloc failed, the cache was
  flushed and the allocation retried — the allocator is already at the wall) close half the
  remaining distance to 1: risk + (1 − risk) × 0.5.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

HIGH_RISK = 0.8
_HEADROOM_FREE_BELOW = 0.75
_HEADROOM_HIGH_AT = 0.90
_RETRY_WEIGHT = 0.5
# Theil–Sen needs a handful of points before a median slope means anything; with fewer, one
# spike is a third of the data. It costs n²/2 slopes: 32 points are ~500, well under a
# millisecond, and half a minute of history at one step per second.
MIN_TREND_POINTS = 5
TREND_WINDOW_POINTS = 32
DROP_SHARE = 0.05
"""A peak this share of capacity below the median of the few before it means memory was
freed (an evaluation ended, the cache was emptied): the trend starts again from it. Without
this, growth from before the fall kept predicting an OOM seconds away with the GPU empty
(seen on an H200: 115 GiB held, freed, and the risk stayed at 1.0)."""
_DROP_BASELINE_POINTS = 5


@dataclass(frozen=True, slots=True)
class OomRisk:
    """How close one GPU is to running out of memory, and why."""

    headroom_bytes: int | None
    """Capacity − max(NVML used, torch reserved); ``None`` when neither nor a peak is known."""
    fragmentation_ratio: float | None
    """1 − allocated/reserved: cached memory the allocator holds but no tensor uses."""
    peak_trend_bytes_per_second: float | None
    """Robust (Theil–Sen) slope of the per-step peaks; ``None`` with too few points."""
    predicted_seconds: float | None
    """Time until the trend reaches capacity; ``None`` when peaks are not growing."""
    predicted_steps: float | None
    risk_ratio: float
    reasons: tuple[str, ...]


def theil_sen(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Median-of-pairwise-slopes line ``(slope, intercept)``, or ``None`` without two distinct t.

    Robust to outliers (breakdown point ~29%): one spiking step moves few of the pairwise
    slopes, so it cannot create a trend that least squares would report.
    """
    slopes = [
        (y2 - y1) / (t2 - t1)
        for i, (t1, y1) in enumerate(points)
        for t2, y2 in points[i + 1 :]
        if t2 != t1
    ]
    if not slopes:
        return None
    slope = statistics.median(slopes)
    intercept = statistics.median(y - slope * t for t, y in points)
    return slope, intercept


def assess_oom_risk(
    peaks: Sequence[tuple[float, int]],
    *,
    capacity_bytes: int,
    nvml_used_bytes: int | None,
    reserved_bytes: int | None,
    allocated_bytes: int | None,
    alloc_retries_delta: int,
    ooms_delta: int,
    step_period_s: float | None,
    horizon_s: float = 600.0,
) -> OomRisk:
    """Headroom, fragmentation, peak trend, predicted time to OOM and a composite 0–1 risk.

    ``peaks`` are ``(unix seconds, per-step allocator peak bytes)``, any order; the last
    ``TREND_WINDOW_POINTS`` are used for the trend. The peaks can only grow into the memory
    other users of the device leave free, so NVML's usage beyond torch's reservation (CUDA
    context, other processes) is subtracted from the capacity they are projected against.
    """
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes!r}")
    if horizon_s <= 0:
        raise ValueError(f"horizon_s must be positive, got {horizon_s!r}")
    reasons: list[str] = []
    recent = _since_last_drop(sorted(peaks)[-TREND_WINDOW_POINTS:], DROP_SHARE * capacity_bytes)

    in_use = [b for b in (nvml_used_bytes, reserved_bytes) if b is not None]
    if not in_use and recent:
        in_use = [recent[-1][1]]
    headroom = capacity_bytes - max(in_use) if in_use else None

    fragmentation = None
    if allocated_bytes is not None and reserved_bytes:
        fragmentation = min(1.0, max(0.0, 1.0 - allocated_bytes / reserved_bytes))

    overhead = 0
    if nvml_used_bytes is not None and reserved_bytes is not None:
        overhead = max(0, nvml_used_bytes - reserved_bytes)
    reachable = capacity_bytes - overhead

    slope: float | None = None
    predicted_s: float | None = None
    line = None
    if len(recent) >= MIN_TREND_POINTS:
        # Time relative to the newest point keeps unix-second magnitudes out of the intercept,
        # which is then the trend's level now.
        t_last = recent[-1][0]
        line = theil_sen([(t - t_last, float(b)) for t, b in recent])
    if line is not None:
        slope, level = line
        if slope > 0:
            predicted_s = max(0.0, (reachable - level) / slope)
    predicted_steps = None
    if predicted_s is not None and step_period_s is not None and step_period_s > 0:
        predicted_steps = predicted_s / step_period_s

    head_risk = 0.0
    if headroom is not None:
        used = 1.0 - headroom / capacity_bytes
        head_risk = _headroom_risk(used)
        if used >= _HEADROOM_HIGH_AT:
            reasons.append(f"headroom {headroom / capacity_bytes:.0%} of capacity")
    trend_risk = 0.0
    if predicted_s is not None:
        if predicted_s <= horizon_s:
            trend_risk = HIGH_RISK + (1.0 - HIGH_RISK) * (1.0 - predicted_s / horizon_s)
            reasons.append(f"peaks reach capacity in ~{predicted_s:.0f} s at the current trend")
        else:
            trend_risk = HIGH_RISK * horizon_s / predicted_s
    risk = max(head_risk, trend_risk)
    if alloc_retries_delta > 0:
        risk += (1.0 - risk) * _RETRY_WEIGHT
        reasons.append(f"{alloc_retries_delta} allocator retries (cache flushed to fit)")
    if ooms_delta > 0:
        risk = 1.0
        reasons.append(f"{ooms_delta} out-of-memory error(s)")

    return OomRisk(
        headroom_bytes=headroom,
        fragmentation_ratio=fragmentation,
        peak_trend_bytes_per_second=slope,
        predicted_seconds=predicted_s,
        predicted_steps=predicted_steps,
        risk_ratio=min(1.0, max(0.0, risk)),
        reasons=tuple(reasons),
    )


def _since_last_drop(points: list[tuple[float, int]], drop_bytes: float) -> list[tuple[float, int]]:
    """The points from the last one that fell ``drop_bytes`` below the median of the few
    before it (one spike is not a baseline, so the step after it is no fall)."""
    start = 0
    peaks = [b for _, b in points]
    for i in range(1, len(peaks)):
        if peaks[i] < _median(peaks[max(start, i - _DROP_BASELINE_POINTS) : i]) - drop_bytes:
            start = i
    return points[start:]


def _median(values: list[int]) -> float:
    """``statistics.median`` of a few values, without its generality (called per point)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _headroom_risk(used: float) -> float:
    if used <= _HEADROOM_FREE_BELOW:
        return 0.0
    if used <= _HEADROOM_HIGH_AT:
        share = (used - _HEADROOM_FREE_BELOW) / (_HEADROOM_HIGH_AT - _HEADROOM_FREE_BELOW)
        return HIGH_RISK * share
    share = (used - _HEADROOM_HIGH_AT) / (1.0 - _HEADROOM_HIGH_AT)
    return min(1.0, HIGH_RISK + (1.0 - HIGH_RISK) * share)
