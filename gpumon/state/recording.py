"""How the ``--record`` file is doing: what the recorder hands to /metrics and /readyz."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecorderStatus:
    """How the recording is doing, for /metrics and /readyz."""

    path: str
    lines_written_total: int
    lines_dropped_total: int
    write_errors_total: int
    backlog_bytes: int
    error: str | None
    """Why the last write failed, while data is waiting; None once everything is written."""
