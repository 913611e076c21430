"""The fast text exposition: byte for byte what prometheus_client's generate_latest makes."""

from __future__ import annotations

import math

import pytest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import generate_latest

from gpumon.export.exposition import (
    CounterFamily,
    GaugeFamily,
    HistogramFamily,
    RenderCache,
    RowFamily,
    render,
)

VALUES = [0.0, -0.0, 1.0, 0.1, -2.5, 5e-324, 999_999.0, 1e6, 123_456_789.0, 51_234_567_890.0,
          1e15, 1e16, 3.1e17, -5e7, math.inf, -math.inf, math.nan, 7, 2**53 + 1]
LABELS = ["plain", 'a "quoted" value', "back\\slash", "new\nline", "ünïcode", ""]


class _Registry:
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


def _both(make: type, reference: type, name: str, labels: list[str]) -> tuple[Metric, Metric]:
    ours, theirs = make(name, "Help with a \\ and a\nnewline.", labels=labels), \
        reference(name, "Help with a \\ and a\nnewline.", labels=labels)
    for i, value in enumerate(VALUES):
        for family in (ours, theirs):
            family.add_metric([LABELS[i % len(LABELS)], str(i)], value)
    return ours, theirs


def test_row_families_render_as_generate_latest_renders_their_reference() -> None:
    gauge, ref_gauge = _both(GaugeFamily, GaugeMetricFamily, "bench_gauge", ["zone", "a"])
    counter, ref_counter = _both(CounterFamily, CounterMetricFamily, "bench_things_total",
                                 ["b", "rank"])
    histogram, ref_histogram = (
        HistogramFamily("bench_seconds", "A histogram.", labels=["run", "rank"]),
        HistogramMetricFamily("bench_seconds", "A histogram.", labels=["run", "rank"]))
    negative, ref_negative = (
        HistogramFamily("bench_delta", "Negative buckets: no sum, no count.", labels=["run"]),
        HistogramMetricFamily("bench_delta", "Negative buckets: no sum, no count.",
                              labels=["run"]))
    for family in (histogram, ref_histogram):
        family.add_metric(["r\"1", "0"], [("0.5", 1.0), ("2.5", 3.0), ("+Inf", 4.0)], 7.25)
        family.add_metric(["r2", "1"], [("0.5", 0.0), ("+Inf", 0.0)], None)
    for family in (negative, ref_negative):
        family.add_metric(["x"], [("-1.0", 2.0), ("+Inf", 5.0)], 3.0)
    single = GaugeFamily("bench_up", "Unlabelled.", value=1.0)
    ref_single = GaugeMetricFamily("bench_up", "Unlabelled.", value=1.0)
    ours = [gauge, counter, histogram, negative, single]
    theirs = [ref_gauge, ref_counter, ref_histogram, ref_negative, ref_single]
    expected = generate_latest(_Registry(theirs))
    assert render(ours) == expected
    assert render(ours) == expected  # again, from the caches
    assert [f.samples for f in ours] == [f.samples for f in theirs]


def test_other_families_render_sample_by_sample_as_generate_latest_does() -> None:
    created = CounterMetricFamily("bench_created", "With a created time.", labels=["l"])
    created.add_metric(['v"'], 3.0, created=1_700_000_000.5)
    stamped = GaugeMetricFamily("bench_stamped", "With a timestamp.", labels=["l"])
    stamped.add_metric(["v"], 2.0, timestamp=1_700_000_000.25)
    metrics: list[Metric] = [
        InfoMetricFamily("bench_build", "Info.", value={"version": "1.2", "quote": 'x"y'}),
        SummaryMetricFamily("bench_latency", "A summary.", count_value=3, sum_value=0.75),
        created, stamped,
        GaugeMetricFamily("bench.dotted", "A UTF-8 name, escaped to underscores.", value=1.0),
    ]
    assert render(metrics) == generate_latest(_Registry(metrics))


def test_samples_cannot_be_assigned_behind_the_rows_back() -> None:
    family = GaugeFamily("bench_gauge", "Help.", labels=["a"])
    family.add_metric(["x"], 1.0)
    try:
        family.samples = [family.samples[0]]
    except TypeError:
        pass
    else:
        raise AssertionError("assigning samples should fail")
    assert len(family.rows) == 1


Block = list[tuple[str, float]]  # (label value, value) rows of one source


def _families() -> tuple[GaugeFamily, CounterFamily]:
    return (GaugeFamily("bench_gauge", "Help.", labels=["source", "x"]),
            CounterFamily("bench_things_total", "Help.", labels=["source", "x"]))


def _fill(families: tuple[GaugeFamily, CounterFamily], source: tuple[str, Block]) -> None:
    name, rows = source
    for x, value in rows:
        families[0].add_metric([name, x], value)
        if value >= 0:  # some sources have no rows in the second family
            families[1].add_metric([name, x], value)


def _uncached(sources: list[tuple[str, Block]]) -> bytes:
    families = _families()
    for source in sources:
        _fill(families, source)
    return render(families)


def test_render_cache_renders_a_source_again_only_when_its_version_changes() -> None:
    filled: list[str] = []

    def fill(families: tuple[GaugeFamily, CounterFamily], source: tuple[str, Block]) -> None:
        filled.append(source[0])
        _fill(families, source)

    cache = RenderCache(_families, fill)
    data = {"a": [("1", 1.0), ("2", -0.0)], "b": [("1", 2.5)], "c": [("q\"", -1.0)]}
    versions = {"a": 1, "b": 1, "c": 1}

    def scrape() -> bytes:
        return render(cache.families((k, versions[k], (k, data[k])) for k in sorted(data)))

    assert scrape() == _uncached([(k, data[k]) for k in sorted(data)])
    assert filled == ["a", "b", "c"]
    data["b"] = [("1", 3.0), ("3", 0.0)]  # changed, but the version says not: kept as it was
    assert scrape() == _uncached([("a", data["a"]), ("b", [("1", 2.5)]), ("c", data["c"])])
    assert filled == ["a", "b", "c"]
    versions["b"] = 2
    assert scrape() == _uncached([(k, data[k]) for k in sorted(data)])
    assert filled == ["a", "b", "c", "b"]
    del data["a"]
    assert scrape() == _uncached([(k, data[k]) for k in sorted(data)])
    assert len(cache) == 2  # a is forgotten
    data.clear()
    assert scrape() == _uncached([])  # the families' headers stay
    assert len(cache) == 0 and filled == ["a", "b", "c", "b"]


def test_rendered_families_have_no_samples_to_read() -> None:
    cache = RenderCache(_families, _fill)
    family = cache.families([("a", 1, ("a", [("1", 1.0)]))])[0]
    assert not isinstance(family, RowFamily)
    with pytest.raises(TypeError, match="rendered text"):
        family.samples  # noqa: B018
