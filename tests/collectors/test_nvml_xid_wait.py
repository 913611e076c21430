"""The XID watcher's wait, one prepared call into the library: an event, the timeout of a quiet
second, and a failure, each told apart by the call's return code (the fake library's event API,
in a child process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpumon.testing.fakenvml import SCENARIOS
from tests.helpers import ROOT, agent_env

_CHILD = """
import json, sys, time
import pynvml
from gpumon.collectors.nvml import NvmlSource
from gpumon.collectors.nvml.source import XidWatcher
errors = []
source = NvmlSource(lambda collector, error: errors.append(error))
watcher = XidWatcher(source.devices, lambda gpu, xid: None, lambda c, e: errors.append(e),
                     timeout_ms=100)
wait = watcher._prepared_wait()
seen = []
began = time.monotonic()
while time.monotonic() - began < 5 and not any(kind == "event" for kind, _ in seen):
    data = wait()
    seen.append(("timeout", None) if data is None else ("event", int(data.eventData)))
pynvml.nvmlEventSetFree(watcher._event_set)
try:
    wait()
    failed = None
except pynvml.NVMLError as exc:
    failed = exc.value
print(json.dumps({"seen": seen, "failed": failed, "errors": errors,
                  "invalid": pynvml.NVML_ERROR_INVALID_ARGUMENT}))
"""


def test_the_prepared_wait_tells_an_event_a_timeout_and_a_failure_apart(
        tmp_path: Path, fake_nvml_lib: Path) -> None:
    # GPU 1 reports XID 79 about 1 s after the library is loaded.
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                           timeout=60, cwd=ROOT,
                           env=agent_env(fake_nvml_lib.parent, SCENARIOS / "xid79.scn"))
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout.strip().splitlines()[-1])
    kinds = [kind for kind, _ in result["seen"]]
    assert kinds[-1] == "event" and result["seen"][-1][1] == 79
    assert kinds.count("timeout") >= 3 and set(kinds[:-1]) == {"timeout"}  # quiet 100 ms waits
    assert result["failed"] == result["invalid"]  # a freed set: the library's own error
    assert result["errors"] == []
