"""Point-to-point transfers measured between two real ranks (gloo, torchrun): ``send``/``recv``,
``isend``/``irecv`` with their ``Work.wait``, and ``batch_isend_irecv`` with ``P2POp``s made
before the tap. The receiving rank's bubble is its own timing of its receive calls and waits
(``p2p_worker.py``), which the job measures apart from gpumon. Pipelines are in
tests/e2e/test_model_parallel.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpumon.testing import free_port
from tests.helpers import ROOT

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("p2p")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(HERE / "p2p_worker.py"), str(out)],
        capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("step", [0, 1, 2], ids=["send-recv", "isend-irecv-wait", "batch"])
def test_each_transfer_is_counted_with_its_bytes(ranks: list[list[dict[str, Any]]],
                                                 step: int) -> None:
    sender, receiver = ranks[0][step]["comm"], ranks[1][step]["comm"]
    assert sender["ops"]["send"][:2] == [1, 4096]
    assert receiver["ops"]["recv"][:2] == [1, 4096]
    if step == 2:  # both ways
        assert sender["ops"]["recv"][:2] == [1, 4096]
        assert receiver["ops"]["send"][:2] == [1, 4096]


@pytest.mark.parametrize("step", [0, 1, 2], ids=["send-recv", "isend-irecv-wait", "batch"])
def test_the_receivers_wait_is_its_bubble(ranks: list[list[dict[str, Any]]], step: int) -> None:
    """The receiving rank waited about 50 ms for its peer: gpumon's exposed time and bubble are
    its own timing of its receive (within 2 ms: what the tap's bookkeeping costs) and never
    more; a receive is in flight at least as long as it was waited on."""
    record = ranks[1][step]
    comm, own = record["comm"], record["own"]
    assert own > 0.03  # the job's own truth: it did wait
    assert own - 0.002 <= comm["bubble"] <= own
    assert comm["bubble"] <= comm["exposed"] <= record["step"]
    assert comm["ops"]["recv"][2] >= comm["bubble"] - 0.001
    assert ranks[0][step]["comm"].get("bubble", 0.0) < 0.01  # the sender did not wait
