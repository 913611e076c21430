"""A job's own timeline, written as it goes and independent of gpumon: one JSON line per event
(``what``, unix ``t``), flushed at once, starting with the process's kernel start time."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def process_start_unix() -> float:
    """When this process started, by the kernel (``/proc/self/stat``), as unix time."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return time.time() - age


class Timeline:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")
        self.note("start", at=process_start_unix(), pid=os.getpid())

    def note(self, what: str, **fields: object) -> None:
        self._file.write(json.dumps({"what": what, "t": time.time(), **fields}) + "\n")
        self._file.flush()

    def crash(self) -> None:
        """Die at once, as a segfault or an OOM kill would (no exit handlers)."""
        self.note("exit", why="crash")
        os._exit(1)
