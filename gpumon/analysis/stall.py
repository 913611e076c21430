"""Where every rank of a run is when the run stops: each rank's state, and who waits on whom.

Each rank's hook says whether it steps and, once stalled, where its training thread is (a
``state`` record: ``gpumon.client.core.stall``). Here the reports of one run's ranks are joined:

- **state**: ``finished`` once its monitor closed (the hook said so: a clean end, whether
  the process is still there or not); ``exited`` when the agent saw the process end without
  that word (killed, crashed, OOM-killed: it vanished), with where it was last seen;
  ``stalled`` while a fresh report says so and no step arrived since, or when a rank whose hook
  sends heartbeats has sent nothing for ``SILENT_AFTER_S`` while its process lives (a thread
  holding the interpreter's lock stops the hook's thread too: the place is then unknown, and
  the reason is said); ``evaluating`` while a fresh report says the rank progresses outside
  steps (forwards, batches: an evaluation pass), or while it waits in a collective only on
  ranks that do; ``stepping`` otherwise. A hook too old to send reports gives no word of a
  clean end: its ended process is ``exited``.
- **who waits on whom**: in synchronous training every rank enters the same collectives in
  the same order, so each process numbers the collectives it launches. A stalled rank in
  collective number *n* waits on the ranks of its run that are not in collective *n*: stalled
  elsewhere (in their data pipeline, in user code), in another collective, or exited. Ranks
  in the same collective wait together, on none of each other. A rank that skipped a
  collective reaches the stall with a lower count than its peers: they wait on it, and the
  numbers show by how many collectives it is behind; which step it skipped, and that until
  the stall its peers' collectives were paired with its later ones, cannot be told. A rank
  waiting in a collective only on ranks that evaluate (the others wait in a barrier while
  one rank evaluates) is ``evaluating`` too: nothing is stuck.

Pure: times come in as ages (seconds) measured by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpumon.wire import KNOWN_PHASES, StackFrame, StateRecord

__all__ = [
    "REPORT_FRESH_S",
    "SILENT_AFTER_S",
    "RankCondition",
    "RankProgress",
    "join_run",
    "location_label",
    "waits_on_label",
]

STATES = ("stepping", "evaluating", "stalled", "exited", "finished")
REPORT_FRESH_S = 10.0
"""A stall report older than this no longer holds (a stalled hook reports every 2 s)."""
SILENT_AFTER_S = 15.0
"""A hook that sends heartbeats (every 5 s) and has sent nothing for this long, while its
process lives, is stalled with its place unknown: three heartbeats missed."""
MAX_LOCATION_CHARS = 120
MAX_WAITS_ON_SHOWN = 8
SILENT_LOCATION = "unknown: the process lives but its hook sends nothing (a thread holding the GIL?)"
NO_OWN_FRAME_LOCATION = "unknown: no frame of the job's own code on the stack"
NO_STACK_LOCATION = "unknown: the training thread's stack was not read"


@dataclass(frozen=True, slots=True)
class RankProgress:
    """What the agent holds of one rank, as ages at one moment."""

    rank: int
    report: StateRecord | None
    """The hook's latest ``state`` record, if it sends them."""
    report_age_s: float | None
    """Since that record arrived."""
    step_after_report: bool
    """A step record arrived after the report."""
    silent_s: float
    """Since anything arrived from the rank."""
    steps_total: int
    exited: bool = False
    process_alive: bool | None = None
    """Whether the agent sees the process live (``None``: it cannot see it)."""


@dataclass(frozen=True, slots=True)
class RankCondition:
    """One rank's state and, while stalled, its place (the labels of the metrics)."""

    rank: int
    state: str
    phase: str = "none"
    op: str = ""
    location: str = ""
    waits_on: tuple[int, ...] = ()
    stalled_s: float | None = None
    report: StateRecord | None = None

    @property
    def collective_seq(self) -> int | None:
        """The number of the collective it is in, if any."""
        report = self.report
        if self.state != "stalled" or report is None or report.in_flight is None:
            return None
        return report.in_flight.seq

    @property
    def placed(self) -> bool:
        """Whether its place is known and meant: while stalled, and where an exited rank was
        last seen."""
        return self.state == "stalled" or (self.state == "exited" and bool(self.location))


def join_run(ranks: Iterable[RankProgress]) -> list[RankCondition]:
    """Each rank's condition, with whom each stalled rank in a collective waits on."""
    alone = [_condition(progress) for progress in ranks]
    joined = []
    for cond in alone:
        seq = cond.collective_seq
        if seq is not None:
            waits = tuple(sorted(
                other.rank for other in alone
                if other.rank != cond.rank and other.state in ("stalled", "exited", "finished", "evaluating")
                and other.collective_seq != seq))
            evaluating = {other.rank for other in alone if other.state == "evaluating"}
            state = "evaluating" if waits and set(waits) <= evaluating else cond.state
            cond = RankCondition(cond.rank, state, cond.phase, cond.op, cond.location, waits,
                                 cond.stalled_s if state == "stalled" else None, cond.report)
        joined.append(cond)
    return sorted(joined, key=lambda c: c.rank)


def _condition(p: RankProgress) -> RankCondition:
    report = p.report
    if report is not None and report.state == "closed":
        return RankCondition(p.rank, "finished", report=report)
    if p.exited:
        if report is None:
            return RankCondition(p.rank, "exited")
        return RankCondition(p.rank, "exited", phase_label(report.phase), "",
                             _location(report) if report.stack else "", report=report)
    if report is None:
        return RankCondition(p.rank, "stepping")
    if (report.state == "evaluating" and p.report_age_s is not None
            and p.report_age_s <= REPORT_FRESH_S and not p.step_after_report):
        return RankCondition(p.rank, "evaluating", phase_label(report.phase), report=report)
    if (report.state == "stalled" and p.report_age_s is not None
            and p.report_age_s <= REPORT_FRESH_S and not p.step_after_report):
        since = report.since if report.since is not None else report.t
        stalled_s = max(0.0, report.t - since) + p.report_age_s
        flight = report.in_flight
        return RankCondition(p.rank, "stalled", phase_label(report.phase),
                             "" if flight is None else flight.op,
                             _location(report), stalled_s=stalled_s, report=report)
    if p.silent_s > SILENT_AFTER_S and p.steps_total > 0 and p.process_alive is not False:
        return RankCondition(p.rank, "stalled", "unknown", "", SILENT_LOCATION,
                             stalled_s=p.silent_s, report=report)
    return RankCondition(p.rank, "stepping", report=report)


def phase_label(phase: str | None) -> str:
    """The open phase as the metric names it: a known phase, ``other``, or ``none``."""
    if phase is None:
        return "none"
    return phase if phase in KNOWN_PHASES else "other"


def _location(report: StateRecord) -> str:
    frame = report.location
    if frame is not None:
        return location_label(frame)
    return NO_OWN_FRAME_LOCATION if report.stack else NO_STACK_LOCATION


def location_label(frame: StackFrame) -> str:
    """``file.py:LINE function`` (the file's base name), bounded."""
    text = f"{frame.file.rsplit('/', 1)[-1]}:{frame.line} {frame.function}"
    return text if len(text) <= MAX_LOCATION_CHARS else text[: MAX_LOCATION_CHARS - 1] + "…"


def waits_on_label(ranks: tuple[int, ...]) -> str:
    """``1,2,3``: at most ``MAX_WAITS_ON_SHOWN`` ranks, then ``+N`` for the rest."""
    shown = ",".join(str(r) for r in ranks[:MAX_WAITS_ON_SHOWN])
    rest = len(ranks) - MAX_WAITS_ON_SHOWN
    return f"{shown},+{rest}" if rest > 0 else shown
