"""A traced rank's own step records, kept while its trace is written: the sender's transport,
wrapped (``TraceControl.start_tap``), passes every datagram on and keeps the step records of
this run and rank, which give the trace its ``data`` seconds and step numbers."""

from __future__ import annotations

from typing import Any

from gpumon.client.watchers.trace_file import TracedStep, unix_offset
from gpumon.wire import StepRecord, decode_datagram


class RecordTap:
    """Passes datagrams to the transport and keeps this rank's step records (while writing)."""

    def __init__(self, run: str, rank: int) -> None:
        self.run, self.rank = run, rank
        self.inner: Any = None
        self.records: list[StepRecord] = []
        self._unix_offset = unix_offset()

    def wrap(self, inner: Any) -> RecordTap:
        self.inner = inner
        return self

    def send(self, datagram: bytes) -> str | None:
        reason: str | None = self.inner.send(datagram)
        try:
            for record in decode_datagram(datagram).records:
                if isinstance(record, StepRecord) and record.run == self.run and record.rank == self.rank:
                    self.records.append(record)
        except Exception:
            pass
        return reason

    def close(self) -> None:
        self.inner.close()

    def covers(self, step: TracedStep) -> bool:
        """Whether the record of ``step`` (the last traced) has been sent."""
        end_unix = step.end + self._unix_offset
        return any(r.step == step.seq or (r.t_start or 0.0) + r.duration_s >= end_unix
                   for r in self.records)
