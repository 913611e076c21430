"""Reading a Prometheus text exposition: parsed by prometheus_client's own parser (the
reference implementation of the format), then looked up by name and labels."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]
Metrics = dict[tuple[str, Labels], float]
"""{(sample name, labels): value} of one scrape."""


def parse_metrics(text: str) -> Metrics:
    """{(sample name, labels): value} of a text exposition."""
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return out


def series(metrics: Mapping[tuple[str, Labels], float], name: str,
           **labels: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return [(dict(ls), v) for (n, ls), v in metrics.items() if n == name and want <= ls]


def values(metrics: Mapping[tuple[str, Labels], float], name: str, **labels: str) -> list[float]:
    """Values of every series of ``name`` whose labels include ``labels``."""
    return [v for _, v in series(metrics, name, **labels)]


def value(metrics: Mapping[tuple[str, Labels], float], name: str, **labels: str) -> float:
    """The single value of ``name`` with ``labels``; AssertionError if absent or ambiguous."""
    found = values(metrics, name, **labels)
    assert len(found) == 1, f"{name}{labels}: expected one series, found {found}"
    return found[0]


def first(metrics: Mapping[tuple[str, Labels], float], name: str, **labels: str) -> float | None:
    """The value of the first series of ``name`` with ``labels``, or None: for reports that
    record what was there rather than fail on what was not."""
    found = values(metrics, name, **labels)
    return found[0] if found else None

