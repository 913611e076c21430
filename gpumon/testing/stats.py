"""Summaries of measured samples that tests and benchmarks report the same way."""

from __future__ import annotations


def quantile(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples`` by nearest rank: the value of one real
    observation (a p99 of 300 latencies is the third slowest), never an interpolation."""
    if not samples:
        raise ValueError("quantile of no samples")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
