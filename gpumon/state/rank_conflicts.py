"""Two live processes are never one rank: telling a second job's claim on a (run, rank) from a
restart of the rank's own process.

A new sender for a (run, rank) whose process is known to have exited is its restart, and
continues the rank (torchrun's elastic restarts, a job resubmitted under the same name). So is
one whose process the agent sees has ended, checked in ``/proc`` only at that moment: once per
new process per rank, never per datagram. A new sender while the rank's process is still alive
is another job under the same name: a *conflict*. The rank's series stay the first process's;
the second is still watched, under a run of its own, ``<run>:clash-<pid>``, because losing a
job's steps is worse than an unexpected name, and the name says at once what happened and which
process it is. That pair is admitted like any other: the cap on live pairs and the senders'
shares bound it. Each conflict is counted per (run, rank) and logged once.

Where the kernel gives no sender pid (the sender lives in a pid namespace the agent cannot
see), liveness cannot be checked. The pid the client reports (its own, in its namespace) is
then the only handle: a change of it is taken as a restart, as the agent cannot tell, but a
process that was replaced and sends again proves two are alive, and is a conflict from then
on. Two namespaced senders that report the same pid cannot be told apart at all; an agent that
shares the host's pid namespace always can.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from gpumon.analysis.stream import RankKey
from gpumon.collectors.samples import SenderCredentials
from gpumon.wire import MAX_RUN_CHARS, Record

log = logging.getLogger("gpumon.agent")

EARLIER_PIDS = 4
"""Replaced (unverifiable) pids remembered per rank, to see one come back."""

Process = tuple[bool, int]
"""(whether the kernel gave the pid, the pid): who sent a record."""


def clash_run(run: str, pid: int) -> str:
    """The run a clashing process is watched under: the same for every record it sends, so
    forgetting where it goes costs nothing but a recount."""
    suffix = f":clash-{pid}"
    return run[:MAX_RUN_CHARS - len(suffix)] + suffix


def sender_process(sender: SenderCredentials, record: Record) -> Process | None:
    """The kernel's pid for the sender, else the one the record says, else None."""
    if sender.pid is not None:
        return True, sender.pid
    if record.pid is not None:
        return False, record.pid
    return None


class RankClaims:
    """Which processes were found clashing with a rank's own, and how often (by (run, rank)).

    Not thread-safe: the rank store calls it under its lock. ``alive(pid)`` says whether a
    process the agent sees still runs; None: the agent cannot tell, every new sender is a
    restart (as before conflicts were told apart)."""

    def __init__(self, max_routes: int, alive: Callable[[int], bool] | None = None) -> None:
        self._alive = alive
        self._max_routes = max_routes
        self._routes: dict[tuple[RankKey, Process], RankKey] = {}
        self.conflicts_total: Counter[RankKey] = Counter()

    def route(self, key: RankKey, current_kernel_pid: int | None, current_pid: int | None,
              exited: bool, earlier_pids: tuple[int, ...],
              process: Process | None) -> tuple[RankKey | None, tuple[int, ...]]:
        """(the pair ``process``'s record for ``key`` goes to instead, or None for ``key``
        itself; the rank's replaced unverifiable pids, updated)."""
        if process is None:
            return None, earlier_pids
        routed = self._routes.get((key, process))
        if routed is not None:
            return routed, earlier_pids
        visible, pid = process
        if visible:
            if (current_kernel_pid is None or current_kernel_pid == pid or exited
                    or self._alive is None or not self._alive(current_kernel_pid)):
                return None, earlier_pids  # the first, the same, or a restart
        elif current_kernel_pid is not None or current_pid is None or current_pid == pid:
            return None, earlier_pids
        elif pid not in earlier_pids:  # cannot tell: a restart, unless it comes back
            return None, (earlier_pids + (current_pid,))[-EARLIER_PIDS:]
        clash = (clash_run(key[0], pid), key[1])
        if len(self._routes) >= self._max_routes:
            del self._routes[next(iter(self._routes))]
        self._routes[(key, process)] = clash
        self.conflicts_total[key] += 1
        log.warning("run %r rank %d: process %d claims the rank while process %d is alive "
                    "(two jobs under one run name?); its records go to run %r",
                    key[0], key[1], pid, current_kernel_pid or current_pid, clash[0])
        return clash, earlier_pids

    def forget(self, key: RankKey) -> None:
        """``key`` expired or was evicted: its count, and the routes from or to it, go."""
        self.conflicts_total.pop(key, None)
        for route, clash in list(self._routes.items()):
            if route[0] == key or clash == key:
                del self._routes[route]
