"""XID events, taken with each poll round: one prepared look at the event set that tells an
event, an empty set and a failure apart by the call's return code, without waiting; and the
events reaching whoever watches them from the polling thread, with no thread of their own
(the fake library's event API, in a child process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpumon.testing.fakenvml import SCENARIOS
from tests.helpers import ROOT, agent_env

_LOOK = """
import json, sys, time
import pynvml
from gpumon.collectors.nvml import NvmlSource, XidEvents
errors = []
source = NvmlSource(lambda collector, error: errors.append(error))
events = XidEvents(lambda gpu, xid: None, lambda c, e: errors.append(e))
for device in source.devices:
    events.register(device)
look = events.prepared_check()
seen, longest = [], 0.0
began = time.monotonic()
while time.monotonic() - began < 5 and not any(kind == "event" for kind, _ in seen):
    t0 = time.monotonic()
    data = look()
    longest = max(longest, time.monotonic() - t0)
    seen.append(("none", None) if data is None else ("event", int(data.eventData)))
    time.sleep(0.05)
events.close()
try:
    events.prepared_check()()
    failed = None
except pynvml.NVMLError as exc:
    failed = exc.value
print(json.dumps({"seen": seen, "failed": failed, "errors": errors, "longest": longest,
                  "invalid": pynvml.NVML_ERROR_INVALID_ARGUMENT}))
"""

_POLLED = """
import json, threading, time
from gpumon.collectors.nvml import NvmlSource
source = NvmlSource(lambda collector, error: None)
xids, handed = [], set()
watching = source.watch_xids(lambda gpu, xid: xids.append((gpu, xid, threading.current_thread().name)))
began = time.monotonic()
while time.monotonic() - began < 8 and not xids:
    source.poll(time.time(), time.monotonic(),
                lambda samples: handed.add(threading.current_thread().name))
    time.sleep(0.2)
threads = sorted(t.name for t in threading.enumerate())
source.close()
print(json.dumps({"watching": watching, "xids": xids, "handed": sorted(handed),
                  "threads": threads}))
"""


def _child(code: str, fake_nvml_lib: Path) -> dict:
    # GPU 1 reports XID 79 about 1 s after the library is loaded.
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, cwd=ROOT,
                           env=agent_env(fake_nvml_lib.parent, SCENARIOS / "xid79.scn"))
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_the_prepared_look_tells_an_event_an_empty_set_and_a_failure_apart(
        fake_nvml_lib: Path) -> None:
    result = _child(_LOOK, fake_nvml_lib)
    kinds = [kind for kind, _ in result["seen"]]
    assert kinds[-1] == "event" and result["seen"][-1][1] == 79
    assert kinds.count("none") >= 3 and set(kinds[:-1]) == {"none"}
    # No look waited: the fake library's wait blocks until an event or its timeout, as
    # NVML's does, and the look's timeout is 0.
    assert result["longest"] < 0.5, result["longest"]
    assert result["failed"] == result["invalid"]  # a freed set: the library's own error
    assert result["errors"] == []


def test_xid_events_are_taken_by_the_polling_thread_with_the_gpus(fake_nvml_lib: Path) -> None:
    result = _child(_POLLED, fake_nvml_lib)
    assert result["watching"] is True
    assert [(gpu, xid) for gpu, xid, _ in result["xids"]] == [(1, 79)]
    assert {thread for _, _, thread in result["xids"]} <= set(result["handed"])
    assert all(name.startswith("gpumon-nvml-") for name in result["handed"])
    assert not any("xid" in name for name in result["threads"]), result["threads"]
