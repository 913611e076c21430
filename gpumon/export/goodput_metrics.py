"""Where each rank's time went (``analysis.goodput``): goodput, badput by cause, the work not yet
saved, restarts and checkpoints, as Prometheus families (docs/goodput.md).

Fourteen series a rank. They are rendered as text in one block per run (``RenderCache``), kept
with the run's ranks' totals themselves as its version: totals are frozen values, so equal
totals render the same text (non-negative seconds and counts: never -0.0 beside 0.0). A run
is rendered again only when a rank's totals moved: at its steps, or while the clock moves one
(a stall, a restart), as before. Made afresh at each scrape through prometheus_client's
families, they were a fifth of a scrape at 64 ranks (benchmarks/RESULTS.md, "Causes and
fixes", Scrape).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

from prometheus_client.core import Metric

from gpumon.analysis.goodput import CAUSES, TimeTotals
from gpumon.export.exposition import CounterFamily, GaugeFamily, RenderCache

RunTotals = tuple[str, list[tuple[int, TimeTotals]]]
"""A run and its ranks' totals, by rank."""


class _GoodputFamilySet(NamedTuple):
    goodput: CounterFamily
    badput: CounterFamily
    unsaved: GaugeFamily
    restarts: CounterFamily
    checkpoints: CounterFamily


def _families() -> _GoodputFamilySet:
    return _GoodputFamilySet(
        CounterFamily(
            "gpumon_goodput_seconds",
            "Step time of the rank that was kept: its steps once a checkpoint completed after "
            "them (by this rank, or by another rank of its run after the same step number) or "
            "its process finished cleanly.", labels=["run", "rank"]),
        CounterFamily(
            "gpumon_badput_seconds",
            "Time of the rank's processes that did not train the model, by cause: startup "
            "(process start to first step, a restore included), checkpoint (saves and restores "
            "holding the training thread), evaluation, stalled, lost (unsaved steps at a "
            "failure, redone), restart (a failed process's exit to its successor's start), "
            "other.", labels=["run", "rank", "cause"]),
        GaugeFamily(
            "gpumon_unsaved_seconds",
            "Step time the rank did since its last preserved point: the work a failure now "
            "would lose.", labels=["run", "rank"]),
        CounterFamily(
            "gpumon_rank_restarts",
            "Times the rank was continued by a new process after its old one failed (a "
            "torchrun restart, a requeue, a pod restarted under the same job name).",
            labels=["run", "rank"]),
        CounterFamily(
            "gpumon_checkpoints",
            "Checkpoints the rank saved or restored (kind save|load), by result (ok|failed).",
            labels=["run", "rank", "kind", "result"]),
    )


def _fill(f: _GoodputFamilySet, source: RunTotals) -> None:
    run, ranks = source
    for rank, t in ranks:
        labels = [run, str(rank)]
        f.goodput.add_metric(labels, t.goodput_s)
        for cause in CAUSES:
            f.badput.add_metric([*labels, cause], t.badput_s[cause])
        f.unsaved.add_metric(labels, t.unsaved_s)
        f.restarts.add_metric(labels, float(t.restarts))
        for kind, result, count in (("save", "ok", t.saves_ok), ("save", "failed", t.saves_failed),
                                    ("load", "ok", t.loads_ok), ("load", "failed", t.loads_failed)):
            f.checkpoints.add_metric([*labels, kind, result], float(count))


class GoodputFamilies:
    """The goodput families, a block per run (one instance per agent; safe for concurrent
    scrapes, as ``RenderCache`` is)."""

    def __init__(self) -> None:
        self._cache = RenderCache(_families, _fill)

    def families(self, totals: Mapping[tuple[str, int], TimeTotals],
                 unsaved_alert_s: float) -> Iterator[Metric]:
        """The families of every rank that has a ledger, and the agent's alert age for
        unsaved work."""
        runs: dict[str, list[tuple[int, TimeTotals]]] = {}
        for (run, rank), t in sorted(totals.items()):
            runs.setdefault(run, []).append((rank, t))
        yield from self._cache.families((run, tuple(ranks), (run, ranks))
                                        for run, ranks in runs.items())
        yield GaugeFamily(
            "gpumon_unsaved_threshold_seconds",
            "The age of unsaved work past which GpumonWorkAtRisk fires (the agent's "
            "unsaved_alert_seconds).", value=unsaved_alert_s)


def goodput_families(totals: Mapping[tuple[str, int], TimeTotals],
                     unsaved_alert_s: float) -> Iterator[Metric]:
    """The families of every rank that has a ledger, and the agent's alert age for unsaved work
    (rendered afresh; the agent keeps a ``GoodputFamilies``)."""
    return GoodputFamilies().families(totals, unsaved_alert_s)
