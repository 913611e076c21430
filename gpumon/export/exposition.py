"""The text exposition format (0.0.4), rendered fast: the same bytes as prometheus_client's
``generate_latest`` at a fraction of its cost; and OpenMetrics from the same series.

At 8 GPUs × 64 ranks a scrape holds thousands of series. prometheus_client builds a ``Sample``
and a label dict for each, and formats it re-validating its label names on every sample. The
families here keep each series as a row of label values; the renderer keeps the formatted
label sets and values between scrapes (the same ranks and GPUs come back every time, and most
values with them). Other families (prometheus_client's, e.g. the process collector's) are
rendered sample by sample by the same rules. The costs, measured: benchmarks/RESULTS.md,
"Causes and fixes", Scrape.

A ``RenderCache`` goes further for families fed by many sources that mostly stand still
between scrapes (the ranks of training runs): it keeps each source's rendered lines with a
version of the source, and renders again only the sources whose version moved.

The two formats differ only in their family headers (OpenMetrics names a counter's family
without ``_total``, and calls untyped ``unknown``), in ``_created`` samples and in the closing
``# EOF``; a series line reads the same in both. So the rows and the cached blocks serve both,
and only the headers are written per format.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import lru_cache
from typing import Generic, TypeVar

from prometheus_client.core import Metric
from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.samples import Sample

Row = tuple[str, tuple[str, ...], tuple[str, ...], float]
"""(sample name as exposed, label names, label values, value)."""
Families = TypeVar("Families", bound=Sequence["RowFamily"])
Source = TypeVar("Source")

_HEADER_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram",
                 "unknown": "untyped"}
_HEADER_SUFFIXES = {"counter": "_total", "info": "_info"}
_OPENMETRICS_ONLY = ("_created", "_gsum", "_gcount")  # moved to gauges of their own
_SPECIAL_VALUES = {"inf": "+Inf", "-inf": "-Inf", "nan": "NaN"}


class RowFamily(Metric):
    """A metric family whose series are rows; ``samples`` are made only when read."""

    def __init__(self, name: str, documentation: str, typ: str, labels: Sequence[str]) -> None:
        self.rows: list[Row] = []
        Metric.__init__(self, name, documentation, typ)
        self.label_names = tuple(labels)

    @property
    def samples(self) -> list[Sample]:
        """The rows as prometheus_client samples (for code other than ``render``)."""
        return [Sample(name, dict(zip(names, values, strict=True)), value)
                for name, names, values, value in self.rows]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:  # Metric.__init__ sets it empty; series go in through add_metric
            raise TypeError("add series with add_metric")


class GaugeFamily(RowFamily):
    """Like ``GaugeMetricFamily``: series with ``labels``, or the one ``value``."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = (),
                 value: float | None = None) -> None:
        super().__init__(name, documentation, "gauge", labels)
        self._sample_name = _metric_name(self.name)
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """Add a series with these label values."""
        self.rows.append((self._sample_name, self.label_names, tuple(labels), value))


class CounterFamily(RowFamily):
    """Like ``CounterMetricFamily`` with ``labels``: series are named ``<name>_total``."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        super().__init__(name.removesuffix("_total"), documentation, "counter", labels)
        self._sample_name = _metric_name(self.name + "_total")

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """Add a series with these label values."""
        self.rows.append((self._sample_name, self.label_names, tuple(labels), value))


class HistogramFamily(RowFamily):
    """Like ``HistogramMetricFamily`` with ``labels``."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        super().__init__(name, documentation, "histogram", labels)
        self._bucket_names = (*self.label_names, "le")
        self._bucket, self._count, self._sum = (_metric_name(self.name + suffix)
                                                for suffix in ("_bucket", "_count", "_sum"))

    def add_metric(self, labels: Sequence[str], buckets: Sequence[tuple[str, float]],
                   sum_value: float | None) -> None:
        """Add one histogram: cumulative (upper bound, count) pairs ending at +Inf, and sum."""
        values = tuple(labels)
        rows = self.rows
        for bound, count in buckets:
            rows.append((self._bucket, self._bucket_names, (*values, bound), count))
        if float(buckets[0][0]) >= 0 and sum_value is not None:
            rows.append((self._count, self.label_names, values, buckets[-1][1]))
            rows.append((self._sum, self.label_names, values, sum_value))


class TextFamily(Metric):
    """A metric family whose series are already rendered, as ``render`` would write them."""

    def __init__(self, name: str, documentation: str, typ: str, text: str) -> None:
        Metric.__init__(self, name, documentation, typ)
        self.text = text

    @property
    def samples(self) -> list[Sample]:
        """Not kept: the series exist only as text."""
        raise TypeError(f"{self.name} holds rendered text, not samples")

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:  # Metric.__init__ sets it empty
            raise TypeError(f"{self.name} holds rendered text, not samples")


class RenderCache(Generic[Families, Source]):
    """Families whose series come in blocks, one per source (say, a training run's ranks), each
    block rendered once per version of its source and reused, as text, while that lasts.

    ``make()`` returns the families, empty; ``fill(families, source)`` adds one source's series
    to them. Only the blocks of the last call's sources are kept, so memory follows the live
    sources and one that has gone is forgotten. Every block costs a little on each call, so a
    source should be a large group of series that change together.
    """

    def __init__(self, make: Callable[[], Families],
                 fill: Callable[[Families, Source], None]) -> None:
        self._make = make
        self._fill = fill
        self._heads = [(f.name, f.documentation, f.type) for f in make()]
        self._blocks: dict[Hashable, tuple[object, tuple[str, ...]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Sources whose blocks are held."""
        return len(self._blocks)

    def families(self, sources: Iterable[tuple[Hashable, object, Source]]) -> list[TextFamily]:
        """The families of ``sources``: (key, version, source) each, in the order given.

        Equal versions of a key must mean the same series; a version that differs (``!=``)
        renders the block again.
        """
        kept: dict[Hashable, tuple[object, tuple[str, ...]]] = {}
        blocks: list[tuple[str, ...]] = []
        # One caller at a time: a scrape that comes while another caller (a scrape, or the
        # agent rendering ahead) renders a block waits for it and reuses it, instead of
        # rendering it a second time beside it for the same CPU.
        with self._lock:
            held = self._blocks
            for key, version, source in sources:
                block = held.get(key)
                if block is None or block[0] != version:
                    families = self._make()
                    self._fill(families, source)
                    block = (version, tuple([_render_rows(f.rows) for f in families]))
                kept[key] = block
                blocks.append(block[1])
            self._blocks = kept
        return [TextFamily(*head, "".join([texts[i] for texts in blocks]))
                for i, head in enumerate(self._heads)]


def render(metrics: Iterable[Metric]) -> bytes:
    """The text exposition of ``metrics``, byte for byte what ``generate_latest`` makes."""
    out: list[str] = []
    append = out.append
    for metric in metrics:
        mtype = metric.type
        name = _metric_name(metric.name + _HEADER_SUFFIXES.get(mtype, ""))
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        append(f"# HELP {name} {doc}\n# TYPE {name} {_HEADER_TYPES.get(mtype, mtype)}\n")
        if isinstance(metric, TextFamily):
            append(metric.text)
            continue
        if isinstance(metric, RowFamily):
            append(_render_rows(metric.rows))
            continue
        moved: dict[str, list[str]] = {}
        for sample in metric.samples:
            line = (f"{_metric_name(sample.name)}{_labels(sample.labels.items())} "
                    f"{_value(sample.value)}")
            if sample.timestamp is not None:
                line += f" {int(float(sample.timestamp) * 1000):d}"
            suffix = sample.name.removeprefix(metric.name)
            if suffix in _OPENMETRICS_ONLY:
                moved.setdefault(suffix, []).append(line + "\n")
            else:
                append(line + "\n")
        for suffix, lines in sorted(moved.items()):
            gauge = _metric_name(metric.name + suffix)
            append(f"# HELP {gauge} {doc}\n# TYPE {gauge} gauge\n")
            out.extend(lines)
    return "".join(out).encode("utf-8")


def render_openmetrics(metrics: Iterable[Metric]) -> bytes:
    """The OpenMetrics 1.0 exposition of ``metrics``, ``# EOF`` included."""
    out: list[str] = []
    append = out.append
    for metric in metrics:
        if not isinstance(metric, (TextFamily, RowFamily)):
            # prometheus_client's families (info, the process collector's): its own writer
            written: bytes = openmetrics_latest(_Single(metric))  # type: ignore[no-untyped-call]
            text = written.decode("utf-8")
            append(text.removesuffix("# EOF\n"))
            continue
        name = _metric_name(metric.name)
        doc = (metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
               .replace('"', r'\"'))
        append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
        append(metric.text if isinstance(metric, TextFamily) else _render_rows(metric.rows))
    append("# EOF\n")
    return "".join(out).encode("utf-8")


class _Single:
    """One family in the shape prometheus_client's writers read (``collect()``)."""

    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> list[Metric]:
        return [self._metric]


def _render_rows(rows: Iterable[Row]) -> str:
    """The series lines of ``rows``, as ``render`` writes them under their family's header."""
    return "".join([f"{sample_name}{_row_labels(names, values)} {_value(value)}\n"
                    for sample_name, names, values, value in rows])


@lru_cache(maxsize=1024)
def _metric_name(name: str) -> str:
    return escape_metric_name(name)


@lru_cache(maxsize=256)
def _label_name(name: str) -> str:
    return escape_label_name(name)


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    text = ",".join(f'{_label_name(k)}="{_escape(v)}"' for k, v in sorted(pairs))
    return f"{{{text}}}" if text else ""


@lru_cache(maxsize=256)
def _label_format(names: tuple[str, ...]) -> str:
    """A str.format template putting label values in the sorted order of their names."""
    if not names:
        return ""
    order = sorted(range(len(names)), key=names.__getitem__)
    pairs = ",".join(f'{_label_name(names[i])}="{{{i}}}"' for i in order)
    return f"{{{{{pairs}}}}}"


@lru_cache(maxsize=16384)
def _row_labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """A series' label set as exposed."""
    joined = "".join(values)
    if "\\" in joined or "\n" in joined or '"' in joined:
        values = tuple(map(_escape, values))
    return _label_format(names).format(*values)


def _escape(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def _value(value: float) -> str:
    """``floatToGoString``, cached: it runs once per series, and most values come back."""
    if value == 0:  # 0.0 and -0.0 would share a cache entry, and print differently
        return repr(float(value))
    return _nonzero_value(value)


@lru_cache(maxsize=4096)
def _nonzero_value(value: float) -> str:
    text = repr(float(value))
    if value > 0:
        dot = text.find(".")
        if dot > 6:  # Go switches to an exponent sooner than Python
            mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
            return f"{mantissa}e+{dot - 1:02d}"
    if text[-1] in "fn":
        return _SPECIAL_VALUES[text]
    return text
