"""Whose a process is, as the kernel says: its cgroup (``collectors.cgroup``) and its uid.

The edge that reads ``/proc``; parsing is ``collectors.cgroup``'s. A process that has exited
by the time it is read (between the NVML process list and here) is simply not found. The uid
is the real one from ``/proc/<pid>/status``, named through the agent's user database; where
that has no entry (an agent in a container with the image's ``/etc/passwd``, a directory
service the node does not resolve) the number stands, never a guessed name.
"""

from __future__ import annotations

import functools
import os
import pwd
import time
from dataclasses import dataclass
from pathlib import Path

from gpumon.collectors.cgroup import EMPTY, CgroupPlace, parse_cgroup

PROC = Path("/proc")
USER_NAME_KEPT_S = 600.0
"""How long a uid's name is kept: the user database may be a directory server asked over the
network (LDAP, sssd), and the owners cycle names the user of every GPU process every 5 s."""
_user_names: dict[int, tuple[float, str]] = {}


@dataclass(frozen=True, slots=True)
class ProcessFacts:
    """A live process's cgroup place and its user's name (or uid)."""

    place: CgroupPlace
    user: str


def read_process(pid: int, proc: Path = PROC) -> ProcessFacts | None:
    """The facts of ``pid``, or None when it is gone or cannot be read."""
    try:
        cgroup = _read(f"{proc}/{pid}/cgroup")
        status = _read(f"{proc}/{pid}/status")
    except OSError:
        return None
    uid = _real_uid(status)
    place = _place(cgroup)
    if uid is None:
        return ProcessFacts(place, "")
    if place.slurm_uid and place.slurm_uid != str(uid):
        place = EMPTY  # a Slurm cgroup of another user: not this process's job
    return ProcessFacts(place, user_name(uid))


def _read(path: str) -> str:
    """A small file's text, in plain reads (a third of the time of ``Path.read_text``: the
    owners cycle reads two files of every GPU process)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=256)
def _place(cgroup: str) -> CgroupPlace:
    """``parse_cgroup``, once per distinct text: a job's processes share their cgroups' lines,
    read again every cycle."""
    return parse_cgroup(cgroup)


def user_name(uid: int) -> str:
    """The uid's name where the user database has one, else the number; asked again after
    ``USER_NAME_KEPT_S``."""
    now = time.monotonic()
    kept = _user_names.get(uid)
    if kept is not None and now - kept[0] < USER_NAME_KEPT_S:
        return kept[1]
    try:
        name = pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        name = str(uid)
    if len(_user_names) >= 4096:  # bounded, whatever uids come and go
        _user_names.clear()
    _user_names[uid] = (now, name)
    return name


def _real_uid(status: str) -> int | None:
    for line in status.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1])
    return None
