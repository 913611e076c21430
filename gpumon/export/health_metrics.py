"""Prometheus families for the agent's own outputs and inputs that can fail quietly: the
recording file. A failure here loses data without stopping the agent, so it must be seen."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from gpumon.agent.recorder import RecorderStatus
from gpumon.export.exposition import CounterFamily, GaugeFamily


def recording_families(status: RecorderStatus | None) -> Iterator[Metric]:
    """The recording's health (no series without ``--record``)."""
    if status is None:
        return
    yield GaugeFamily("gpumon_recording_up",
                      "1 while the recording file takes every write, 0 while a failed write "
                      "holds data back (retried every second).", value=0.0 if status.error else 1.0)
    lines = CounterFamily("gpumon_recording_lines", "Lines written to the recording file.",
                          labels=[])
    lines.add_metric([], float(status.lines_written_total))
    dropped = CounterFamily("gpumon_recording_dropped_lines",
                            "Lines lost because writes kept failing and the backlog was full.",
                            labels=[])
    dropped.add_metric([], float(status.lines_dropped_total))
    errors = CounterFamily("gpumon_recording_write_errors",
                           "Failed writes to the recording file.", labels=[])
    errors.add_metric([], float(status.write_errors_total))
    yield from (lines, dropped, errors)
    yield GaugeFamily("gpumon_recording_backlog_bytes",
                      "Bytes waiting to be written to the recording file.",
                      value=float(status.backlog_bytes))
