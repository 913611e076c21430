"""Ending a process together with everything it started.

A launcher such as ``torch.distributed.run`` starts its workers in sessions of their own, so
killing the launcher's process group leaves them running: a rank stuck in a collective, or one
spinning with the interpreter lock, would go on using a core (and, on a GPU node, its memory)
long after the test or check that started it.
"""

from __future__ import annotations

import contextlib
import os
import signal

import psutil


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group if it leads one, and every process descended from it
    (found before the first kill, since an orphan is re-parented at once)."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(OSError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(descendants, timeout=10)
