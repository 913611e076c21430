"""Where a rank's time went: each second of its processes' lives counted once, as goodput (step
time that was kept), unsaved (step time not yet kept) or badput by cause (docs/goodput.md).

A ``TimeLedger`` is told, in the order the agent learns them, of the rank's processes starting
(the kernel's start time, on the agent's monotonic clock) and ending, its steps (their
durations), its spans outside steps (checkpoint saves and restores, evaluation passes: the
seconds they held the training thread), the periods its hook says it made no progress (stalled)
or progressed outside steps (evaluating), and the checkpoints that preserve its steps. Times are
the agent's own clock; durations are the hook's measurements of its own steps and spans. The
figures it returns only grow: a counter never goes down.

Within one process's life, from its start to the agent's horizon (the last moment something was
learnt of it, or its exit):

- ``startup``: from the start to its first step's start (a restore before it included);
- steps: unsaved until preserved (a completed save after them, by this rank or another rank of
  the run: a save covers the steps its process had completed when it began, counted from its
  start, and the same count of the other ranks' steps; or the run ending cleanly), then
  goodput; ``lost`` when the process fails first (it exits without having finished: the work
  since the last checkpoint is redone);
- ``checkpoint``, ``evaluation``: spans after the first step;
- ``stalled``: a period the hook reported stalled, from the rank's last step on;
- ``other``: the rest of the life (between steps, anything unrecognised).

Between a failed process's exit and its successor's start: ``restart``, and a restart counted.
A successor after a clean finish is a new stage of the run: no restart, its gap not counted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MAX_RESTART_TIMES = 64
"""Restart moments kept per rank (for a report's time axis)."""

CAUSES = ("startup", "checkpoint", "evaluation", "stalled", "lost", "restart", "other")
"""Every badput cause, in the order reports list them."""

MAX_UNSAVED_ENTRIES = 4096
"""Unsaved steps kept one by one; past this the oldest two are merged (the later count kept:
the merged pair is preserved with the later step, never earlier than it should)."""


@dataclass(frozen=True, slots=True)
class TimeTotals:
    """A rank's time so far, in seconds: goodput, badput by cause, unsaved, and its restarts."""

    goodput_s: float
    badput_s: dict[str, float]
    unsaved_s: float
    restarts: int
    saves_ok: int = 0
    saves_failed: int = 0
    loads_ok: int = 0
    loads_failed: int = 0
    restarted_at: tuple[float, ...] = ()
    """When its successors started, of the latest ``MAX_RESTART_TIMES`` restarts (the clock
    the ledger was given)."""

    @property
    def wall_s(self) -> float:
        """Everything counted: goodput, unsaved and every badput."""
        return self.goodput_s + self.unsaved_s + sum(self.badput_s.values())


class TimeLedger:
    """One rank's goodput and badput accounting (not thread-safe: its owner's lock guards it)."""

    def __init__(self) -> None:
        self._goodput = 0.0
        self._badput = dict.fromkeys(CAUSES, 0.0)
        self._unsaved: deque[list[float]] = deque()  # [ordinal, seconds], oldest first
        self._unsaved_s = 0.0
        self.restarts = 0
        self._restarted_at: deque[float] = deque(maxlen=MAX_RESTART_TIMES)
        self._counts = [0, 0, 0, 0]  # saves ok, failed; loads ok, failed
        # The current (or last) process.
        self._pid: int | None = None
        self._start: float | None = None
        self._horizon: float | None = None
        self._stepped = False
        self._accounted = 0.0  # its life put somewhere other than "other", so far
        self._other_base = 0.0  # "other" of earlier processes
        self._other_max = 0.0  # "other" as last reported (never goes down)
        self._preserved: int = 0  # the process's steps counted from 1: kept up to this one
        self._finished = False
        self._exit: float | None = None
        self._failed = False
        self._period: tuple[str, float] | None = None  # (cause, since) of an open period
        self._steps = 0  # the process's steps received so far
        self._restored = False  # a restore before its first step was counted

    # -- the process -----------------------------------------------------------------------
    def process(self, pid: int | None, start: float, now: float) -> None:
        """A process of this rank is seen for the first time; ``start`` is when it began (the
        kernel's start time on the agent's clock; where unknown, when it first spoke)."""
        start = min(start, now)
        if self._start is not None:
            if self._exit is None:  # it ended before the agent saw it: after its last word
                self.ended(min(self._horizon or start, start))
            if self._failed and self._exit is not None:
                self._badput["restart"] += max(0.0, start - self._exit)
                self.restarts += 1
                self._restarted_at.append(start)
            self._other_base = self._other_now()
        self._pid, self._start, self._horizon = pid, start, start
        self._stepped, self._accounted, self._finished = False, 0.0, False
        self._exit, self._failed, self._period, self._preserved = None, False, None, 0
        self._steps, self._restored = 0, False

    @property
    def pid(self) -> int | None:
        """The current process's pid, as given to ``process``."""
        return self._pid

    @property
    def started(self) -> bool:
        """Whether any process of the rank is known."""
        return self._start is not None

    def ended(self, at: float) -> None:
        """The current process exited at ``at``: its unsaved work is lost unless it finished."""
        if self._start is None or self._exit is not None:
            return
        at = max(at, self._start)
        self._close_period(at)
        self._horizon = max(self._horizon or at, at)
        self._exit = at
        if self._finished:
            return
        self._failed = True
        self._badput["lost"] += self._unsaved_s
        self._unsaved.clear()
        self._unsaved_s = 0.0

    def finished(self, now: float) -> None:
        """The process closed its monitor cleanly (the run, or its part of it, is done): every
        step it did is kept."""
        self._see(now)
        self._finished = True
        self._preserve(None)

    # -- what it did -----------------------------------------------------------------------
    def step(self, duration_s: float, now: float) -> None:
        """A step of ``duration_s`` seconds ended (learnt at ``now``): the process's next."""
        self._see(now)
        assert self._start is not None
        self._steps += 1
        if self._exit is not None:  # it arrived after the process was seen to end
            self._accounted += duration_s
            if self._failed:
                self._badput["lost"] += duration_s
            else:
                self._goodput += duration_s
            return
        began = max(self._start, now - duration_s)
        if not self._stepped:
            self._stepped = True
            self._period = None  # anything before the first step is its startup
            # (what was accounted before it is spans it came before, sent ahead of it)
            startup = max(0.0, began - self._start)
            self._badput["startup"] += startup
            self._accounted += startup
        kept = duration_s
        if self._period is not None:  # a stalled step's hang is the stall's, not the step's
            cause, since = self._period
            held = max(0.0, min(duration_s, now - since))
            if cause == "stalled":
                kept = duration_s - held
            self._badput[cause] += held if cause == "stalled" else max(0.0, began - since)
            self._accounted += held if cause == "stalled" else max(0.0, began - since)
            self._period = None
        self._accounted += kept
        if self._steps <= self._preserved or self._finished:  # a save or the finish covers it
            # (the sender sends its controls ahead of the steps it still holds)
            self._goodput += kept
        else:
            self._add_unsaved(self._steps, kept)

    def span(self, kind: str, seconds: float, ok: bool | None, steps: int | None,
             now: float) -> int | None:
        """A save (``kind`` ``save``), restore (``load``) or evaluation (``eval``) held the
        training thread ``seconds`` (after the first step: badput; before it, part of the
        startup; ``steps`` says which, for a span that arrives ahead of the steps it
        followed); ``saved``: an asynchronous save finished writing. A save that succeeded
        keeps the process's first ``steps`` steps (the steps it had completed when the save
        began; all received so far where the hook did not say). The reads of a restore before
        the process's first step (a framework reads its weights, optimizer and scheduler
        apart) count as one restore. Returns that count, for the run's other ranks, or None."""
        self._see(now)
        restoring = kind == "load" and not self._stepped
        if kind in ("save", "saved", "load") and ok is not None and not (
                restoring and self._restored):  # the reads of one restore, before the first step
            self._counts[(2 if kind == "load" else 0) + (0 if ok else 1)] += 1
            self._restored = self._restored or bool(restoring and ok)
        if seconds > 0 and (self._stepped or (steps or 0) > 0) and kind != "saved":
            cause = "evaluation" if kind == "eval" else "checkpoint"
            if self._period is not None and self._period[0] == "evaluation" and cause == "evaluation":
                self._period = None  # the span measured the evaluation the period guessed at
            self._badput[cause] += seconds
            self._accounted += seconds
        if kind not in ("save", "saved") or not ok:
            return None
        covered = self._steps if steps is None else steps
        self._preserve(covered)
        return covered

    def preserve(self, steps: int) -> None:
        """Another rank of the run completed a save covering its first ``steps`` steps: this
        rank's first ``steps`` are kept too."""
        self._preserve(steps)

    def outside(self, cause: str | None, since: float, now: float) -> None:
        """The hook says the rank is ``stalled`` (no progress) or ``evaluation`` (progress
        outside steps) since ``since`` (its last step, on the agent's clock); ``None`` cause:
        neither any more."""
        if self._start is None or self._exit is not None or not self._stepped:
            return
        if self._period is not None and self._period[0] != cause:
            self._close_period(now)
        if cause in ("stalled", "evaluation") and self._period is None:
            self._period = (cause, max(since, self._horizon or since) if cause == "stalled"
                            else since)
        if cause == "stalled":
            self._horizon = max(self._horizon or now, now)

    # -- reading ---------------------------------------------------------------------------
    def totals(self, now: float) -> TimeTotals:
        """The figures as of ``now`` (each only grows between calls)."""
        badput = dict(self._badput)
        if self._period is not None and self._exit is None:
            cause, since = self._period
            if cause == "stalled":
                badput["stalled"] += max(0.0, now - since)
        self._other_max = max(self._other_max, self._other_now())
        badput["other"] = self._other_max
        saves_ok, saves_failed, loads_ok, loads_failed = self._counts
        return TimeTotals(self._goodput, badput, self._unsaved_s, self.restarts, saves_ok,
                          saves_failed, loads_ok, loads_failed, tuple(self._restarted_at))

    # -- inside ----------------------------------------------------------------------------
    def _see(self, now: float) -> None:
        if self._start is None:
            self.process(None, now, now)
        elif self._exit is not None:  # word from a process already seen to exit: its last
            return
        self._horizon = max(self._horizon or now, now)

    def _other_now(self) -> float:
        if self._start is None:
            return self._other_base
        life = (self._horizon or self._start) - self._start
        return self._other_base + max(0.0, life - self._accounted - self._open_stall())

    def _open_stall(self) -> float:
        if self._period is None or self._period[0] != "stalled" or self._horizon is None:
            return 0.0
        return max(0.0, self._horizon - self._period[1])

    def _close_period(self, at: float) -> None:
        if self._period is None:
            return
        cause, since = self._period
        held = max(0.0, at - since)
        self._badput[cause] += held
        self._accounted += held
        self._period = None

    def _add_unsaved(self, ordinal: int, seconds: float) -> None:
        if len(self._unsaved) >= MAX_UNSAVED_ENTRIES:
            first = self._unsaved.popleft()
            self._unsaved[0][1] += first[1]
        self._unsaved.append([float(ordinal), seconds])
        self._unsaved_s += seconds

    def _preserve(self, steps: int | None) -> None:
        if steps is None:
            self._preserved = self._steps
            self._goodput += self._unsaved_s
            self._unsaved.clear()
            self._unsaved_s = 0.0
            return
        self._preserved = max(self._preserved, steps)
        while self._unsaved and self._unsaved[0][0] <= steps:
            seconds = self._unsaved.popleft()[1]
            self._goodput += seconds
            self._unsaved_s -= seconds
        if not self._unsaved:
            self._unsaved_s = 0.0
