"""Where each rank's time went, fed from what the rank store ingests (``analysis.goodput`` keeps
the accounts; here the store's records become its calls).

A process's life starts at the kernel's start time where the agent sees the process (the
``started`` callback reads ``/proc`` in the agent), else when it first spoke. The hook's
``state`` records open and close the periods outside steps (stalled, evaluating); a ``finished``
event keeps a process's steps; a completed save keeps as many of its run's other ranks'
steps as it covers of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpumon.analysis.goodput import TimeLedger

FINISHED_EVENT = "finished"
"""The event a hook sends when its process closes its monitor without an exception escaping:
the rank's part of the run is done, and its steps are kept."""

_PERIODS = {"stalled": "stalled", "evaluating": "evaluation"}


def account_process(ledger: TimeLedger | None, pid: int | None, visible: bool,
                    started: Callable[[int], float | None] | None,
                    monotonic: float) -> TimeLedger | None:
    """The ledger, told of ``pid``'s process if it is new to it (made at the first pid)."""
    if pid is None:
        return ledger
    if ledger is None:
        ledger = TimeLedger()
    elif ledger.started and ledger.pid == pid:
        return ledger
    start = started(pid) if visible and started is not None else None
    ledger.process(pid, monotonic if start is None else start, monotonic)
    return ledger


def account_state(ledger: TimeLedger | None, state: str, last_step_monotonic: float | None,
                  monotonic: float) -> None:
    """The hook's word on its progress: a period stalled or evaluating since its last step
    (by the agent's clock), or neither."""
    if ledger is None:
        return
    since = last_step_monotonic if last_step_monotonic is not None else monotonic
    ledger.outside(_PERIODS.get(state), since, monotonic)


def preserve_run(ledgers: Iterable[tuple[tuple[str, int], TimeLedger | None]], run: str,
                 saver: int, steps: int) -> None:
    """A rank of ``run`` completed a save covering its first ``steps`` steps: the run's other
    ranks' first ``steps`` are kept too (a job whose rank 0 alone writes the checkpoint;
    its ranks step together)."""
    for (other_run, rank), ledger in ledgers:
        if other_run == run and rank != saver and ledger is not None:
            ledger.preserve(steps)
