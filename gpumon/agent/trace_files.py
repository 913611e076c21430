"""The trace files in the agent's trace directory: what counts as one, and its run, rank and first
step, read from its name."""

from __future__ import annotations

import os
import re
import stat

from gpumon.wire.traces import TRACE_SUFFIX

TRACE_FILE = re.compile(r"^(?P<run>.+)\.rank(?P<rank>\d+)\.step(?P<step>\d+)" + re.escape(TRACE_SUFFIX) + "$")


def trace_files(directory: str) -> list[tuple[str, str, os.stat_result]]:
    """(name, path, stat) of every regular trace file in ``directory`` (none if unreadable)."""
    out: list[tuple[str, str, os.stat_result]] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if not name.endswith(TRACE_SUFFIX) or name.startswith("."):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((name, path, st))
    return out
