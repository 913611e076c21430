"""Which training processes have ended: each pid the ingest socket's credentials named, checked
in ``/proc``.

A process is taken to have ended when its ``/proc/PID`` is gone, when it is a zombie (dead,
not yet reaped by its launcher), or when the pid now belongs to another process (its start
time differs from the one first seen: pids are reused). A pid the kernel gave as 0 (the
sender lives in a pid namespace the agent cannot see) never reaches here. ``alive`` asks the
same of one pid at once, when a second process claims a rank.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def parse_stat(text: str) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from the text of ``/proc/PID/stat``, or None.

    The command name (field 2) is in parentheses and may hold spaces and parentheses itself:
    the fields after it are read from the last ``)``."""
    end = text.rfind(")")
    if end < 0:
        return None
    fields = text[end + 1:].split()
    # After the name: state is field 3, starttime field 22 (1-based), i.e. index 0 and 19 here.
    if len(fields) < 20:
        return None
    try:
        return fields[0], int(fields[19])
    except ValueError:
        return None


class ProcessLiveness:
    """Remembers each pid's start time at first sight and says which pids have ended since."""

    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc
        self._started: dict[int, int] = {}

    def alive(self, pid: int) -> bool:
        """Whether ``pid``'s process still runs (and is the one first seen under it, where it
        was): one read of its ``/proc/PID/stat``. Safe beside ``ended`` on another thread."""
        try:
            stat = parse_stat((self._proc / str(pid) / "stat").read_text())
        except OSError:
            return False
        if stat is None:
            return False
        state, started = stat
        return state not in ("Z", "X") and started == self._started.get(pid, started)

    def ended(self, pids: set[int]) -> set[int]:
        """The pids among ``pids`` whose process has ended (forgetting pids no longer asked about)."""
        gone = set()
        for pid in pids:
            try:
                stat = parse_stat((self._proc / str(pid) / "stat").read_text())
            except OSError:  # no such process (or no longer readable: it went away)
                stat = None
            if stat is None:
                gone.add(pid)
                continue
            state, started = stat
            first = self._started.setdefault(pid, started)
            if state in ("Z", "X") or started != first:
                gone.add(pid)
        for pid in list(self._started):
            if pid not in pids or pid in gone:
                del self._started[pid]
        return gone
