"""Where each rank's time went (``analysis.goodput``): goodput, badput by cause, the work not yet
saved, restarts and checkpoints, as Prometheus families (docs/goodput.md)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily as CounterFamily
from prometheus_client.core import GaugeMetricFamily as GaugeFamily
from prometheus_client.core import Metric

from gpumon.analysis.goodput import CAUSES, TimeTotals


def goodput_families(totals: Mapping[tuple[str, int], TimeTotals],
                     unsaved_alert_s: float) -> Iterator[Metric]:
    """The families of every rank that has a ledger, and the agent's alert age for unsaved work."""
    goodput = CounterFamily(
        "gpumon_goodput_seconds",
        "Step time of the rank that was kept: its steps once a checkpoint completed after "
        "them (by this rank, or by another rank of its run after the same step number) or "
        "its process finished cleanly.", labels=["run", "rank"])
    badput = CounterFamily(
        "gpumon_badput_seconds",
        "Time of the rank's processes that did not train the model, by cause: startup "
        "(process start to first step, a restore included), checkpoint (saves and restores "
        "holding the training thread), evaluation, stalled, lost (unsaved steps at a "
        "failure, redone), restart (a failed process's exit to its successor's start), "
        "other.", labels=["run", "rank", "cause"])
    unsaved = GaugeFamily(
        "gpumon_unsaved_seconds",
        "Step time the rank did since its last preserved point: the work a failure now "
        "would lose.", labels=["run", "rank"])
    restarts = CounterFamily(
        "gpumon_rank_restarts",
        "Times the rank was continued by a new process after its old one failed (a "
        "torchrun restart, a requeue, a pod restarted under the same job name).",
        labels=["run", "rank"])
    checkpoints = CounterFamily(
        "gpumon_checkpoints",
        "Checkpoints the rank saved or restored (kind save|load), by result (ok|failed).",
        labels=["run", "rank", "kind", "result"])
    for (run, rank), t in sorted(totals.items()):
        labels = [run, str(rank)]
        goodput.add_metric(labels, t.goodput_s)
        for cause in CAUSES:
            badput.add_metric([*labels, cause], t.badput_s[cause])
        unsaved.add_metric(labels, t.unsaved_s)
        restarts.add_metric(labels, float(t.restarts))
        for kind, result, count in (("save", "ok", t.saves_ok), ("save", "failed", t.saves_failed),
                                    ("load", "ok", t.loads_ok), ("load", "failed", t.loads_failed)):
            checkpoints.add_metric([*labels, kind, result], float(count))
    yield from (goodput, badput, unsaved, restarts, checkpoints)
    yield GaugeFamily(
        "gpumon_unsaved_threshold_seconds",
        "The age of unsaved work past which GpumonWorkAtRisk fires (the agent's "
        "unsaved_alert_seconds).", value=unsaved_alert_s)
