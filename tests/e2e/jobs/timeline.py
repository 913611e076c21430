"""A job's own timeline, written as it goes and independent of gpumon: one JSON line per event
(``what``, unix ``t``), flushed at once, starting with the process's kernel start time and
ending with the moment the process was gone (``gone``), noted by a small watcher process of its
own that waits on the process's pidfd (so the teardown after the job's last line counts, and a
crash's exit is the kernel's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

WATCHER = """
import json, os, select, sys, time
fd = os.pidfd_open(int(sys.argv[2]))
print("ready", flush=True)
select.select([fd], [], [])
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"what": "gone", "t": time.time()}) + "\\n")
"""


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
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMON", "PYTHONPATH"))}
        watcher = subprocess.Popen([sys.executable, "-S", "-c", WATCHER, str(path), str(os.getpid())],
                                   stdout=subprocess.PIPE, text=True, env=env,
                                   start_new_session=True)
        assert watcher.stdout is not None and watcher.stdout.readline().strip() == "ready"

    def note(self, what: str, **fields: object) -> None:
        self._file.write(json.dumps({"what": what, "t": time.time(), **fields}) + "\n")
        self._file.flush()

    def crash(self) -> None:
        """Die at once, as a segfault or an OOM kill would (no exit handlers)."""
        self.note("exit", why="crash")
        os._exit(1)
