"""Prometheus families for what can lose data without stopping the agent, so must be seen:
the recording file, the ingest socket, (run, rank) pairs evicted under the cap, and ranks two
live processes claimed."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from gpumon.collectors.ingest import IngestStatus
from gpumon.export.exposition import CounterFamily, GaugeFamily
from gpumon.state.recording import RecorderStatus


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


def eviction_families(evicted: dict[str, int]) -> Iterator[Metric]:
    """(run, rank) pairs evicted to make room under the cap, by reason."""
    family = CounterFamily(
        "gpumon_ingest_ranks_evicted",
        "Live (run, rank) pairs evicted to make room for another under max_ranks: "
        "over_share (their user held more than its share of the cap), process_over_share "
        "(their process held more than its share of its user's pairs), idle (the same "
        "user's pair that had been silent longest).", labels=["reason"])
    for reason, count in sorted(evicted.items()):
        family.add_metric([reason], float(count))
    yield family


def conflict_families(conflicts: dict[tuple[str, int], int]) -> Iterator[Metric]:
    """Live (run, rank) pairs a second live process claimed (``state.rank_conflicts``)."""
    family = CounterFamily(
        "gpumon_rank_conflicts",
        "Times a second process claimed this (run, rank) while its own process was alive: "
        "another job under the same run name. The rank's series stay its own process's; the "
        "other is watched as run <run>:clash-<pid>.", labels=["run", "rank"])
    for (run, rank), count in sorted(conflicts.items()):
        family.add_metric([run, str(rank)], float(count))
    yield family


def ingest_families(status: IngestStatus | None) -> Iterator[Metric]:
    """Whether training steps can arrive, and who may send them (the socket's group and
    mode): a job that cannot write to the socket loses every record without the agent
    seeing one, so this is the only place it shows on the agent's side."""
    if status is None:
        return
    yield GaugeFamily("gpumon_ingest_up",
                      "1 while the ingest socket receives training-step records, 0 when it "
                      "could not be set up (see /readyz).", value=1.0 if status.up else 0.0)
    if status.mode is not None:
        info = GaugeFamily("gpumon_ingest_socket_info",
                           "The ingest socket: its path, the group allowed to send and its "
                           "mode.", labels=["path", "group", "mode"])
        info.add_metric([status.path, status.group or "", f"{status.mode:04o}"], 1.0)
        yield info
    yield GaugeFamily("gpumon_ingest_rings",
                      "Step rings of live training processes the agent holds, read when they "
                      "end.", value=float(status.rings_held))
    recovered = CounterFamily("gpumon_ingest_ring_records",
                              "Steps read from the rings of ended processes: records they had "
                              "not sent when they died.", labels=[])
    recovered.add_metric([], float(status.ring_records_total))
    yield recovered
