"""The functional collectives DTensor issues, measured in-process (gloo, a world of one): each
launch with its payload, the wait on its tensor as the time it held the thread up, and under
``torch.compile`` nothing added to the graph (no graph break). Multi-rank tensor parallelism,
against ``CommDebugMode``, is in tests/e2e/test_model_parallel.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gpumon.client.comm.ledger import CommLedger
from tests.helpers import ROOT

HERE = Path(__file__).resolve().parent


pytestmark = pytest.mark.usefixtures("world_of_one")


def _step(ledger: CommLedger, body: Any) -> dict[str, Any]:
    fields: dict[str, object] = {}
    ledger.step_begin()
    body()
    ledger.step_end(fields)
    comm = fields.get("comm")
    assert isinstance(comm, dict)
    return comm


def test_functional_collectives_are_counted_with_their_payload(ledger: CommLedger) -> None:
    from torch.distributed import _functional_collectives as funcol

    group = dist.group.WORLD

    def body() -> None:
        x = torch.ones(1000)  # 4,000 bytes
        y = funcol.all_reduce(x, "sum", group)
        z = funcol.all_gather_tensor(y, 0, group)  # its output: 4,000 bytes in a world of one
        w = funcol.reduce_scatter_tensor(z, "sum", 0, group)
        v = funcol.all_to_all_single(w, None, None, group)
        assert float(v.sum()) == 1000.0  # using it waits on it

    comm = _step(ledger, body)
    assert comm["ops"]["all_reduce"][:2] == [1, 4000]
    assert comm["ops"]["all_gather"][:2] == [1, 4000]
    assert comm["ops"]["reduce_scatter"][:2] == [1, 4000]
    assert comm["ops"]["all_to_all"][:2] == [1, 4000]
    assert "bubble" not in comm  # no point-to-point receive
    assert 0 < comm["exposed"] <= comm["busy"]


def test_the_wait_on_a_functional_collective_is_exposed_and_its_launch_is_not_its_end(
        ledger: CommLedger) -> None:
    """Work between the launch and the first use of its tensor overlaps the collective: the
    collective is in flight until the wait, and the thread's work meanwhile is not exposed
    (the work is timed on the thread's CPU clock: time off a CPU while a collective is in
    flight counts as held up by it, docs/architecture.md §5.1)."""
    from torch.distributed import _functional_collectives as funcol

    wall = []

    def body() -> None:
        start = time.perf_counter()
        y = funcol.all_reduce(torch.ones(100), "sum", dist.group.WORLD)
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # 50 ms of work on a CPU while it is in flight
            pass
        assert float(y.sum()) == 100.0
        wall.append(time.perf_counter() - start)

    comm = _step(ledger, body)
    assert comm["busy"] >= 0.05
    # The thread's 50 ms on a CPU were work, never exposed, however long a loaded host kept
    # it waiting for one (which the ledger counts as contention while the collective flies).
    assert comm["exposed"] <= wall[0] - 0.05 + 0.002


def test_the_tap_adds_no_graph_break_to_compiled_functional_collectives() -> None:
    """``torch._dynamo.explain`` over all-reduce, all-gather, reduce-scatter and all-to-all,
    in a fresh process without gpumon and with its tap: the same graphs, no break."""
    found = {}
    for mode in ("plain", "tap"):
        done = subprocess.run([sys.executable, str(HERE / "funcol_graph.py"), mode],
                              capture_output=True, text=True, timeout=180, cwd=ROOT,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                   "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        found[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["tap"] == found["plain"]
    assert found["tap"]["breaks"] == 0 and found["tap"]["graphs"] == 1
    assert len(found["tap"]["ops"]) == 5  # the four collectives and their wait, traced
