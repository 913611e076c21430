"""``ClientStats``: what a monitor counted so far (``StepMonitor.stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ClientStats:
    """What a monitor did so far: steps timed, records sent, records lost by reason, fields
    left out as invalid, and errors raised inside watchers (``watch()``), which never reach
    the training loop."""

    steps: int
    records_sent: int
    datagrams_sent: int
    dropped: dict[str, int] = field(default_factory=dict)
    invalid_fields: int = 0
    extension_errors: int = 0
    gpu_fields_missed: int = 0
    """Measured fields timed on the GPU (a step's ``comm`` under NCCL) left out because the
    GPU had not passed their events in time."""
    state_reports: int = 0
    """``state`` records sent: the hook's word that it is alive, and where a stalled rank is
    (not counted among ``records_sent``; one that could not be sent is not retried)."""
    backlog_records: int = 0
    """Records waiting for the agent (absent, restarting or busy), sent in order once it
    answers; bounded (``client/core/backlog.py``), the excess counted in ``dropped``."""
    backlog_bytes: int = 0
    """The datagrams they fill."""
    late_records: int = 0
    """Records sent after waiting in the backlog (counted among ``records_sent`` too)."""
