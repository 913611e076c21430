"""`gpumon estimate --from-run`: a run's measured memory beside its ZeRO projections, read from a
real agent."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT, AgentProcess, start_agent, wait_for

GB = 10**9
# A 7B model in bf16 with AdamW and fp32 masters (K = 12), as one data-parallel rank holds it.
MEMB = {"parameters": 14 * GB, "gradients": 14 * GB, "optimizer_states": 84 * GB,
        "activations": 10 * GB, "other": 2 * GB}


def estimate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumon.cli", "estimate", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.fixture(scope="module")
def agent_with_a_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    process = start_agent(tmp_path_factory.mktemp("estimate"), "--simulate", "1",
                          "--interval", "0.25")
    try:
        _, snapshot = process.json("/api/v1/snapshot")
        uuid = snapshot["gpus"][0]["uuid"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            for rank in range(2):  # rank 1 holds a little more: the one shown
                memb = {**MEMB, "other": MEMB["other"] + rank * GB}
                for step in range(3):
                    record = {"v": 1, "kind": "step", "run": "llm", "rank": rank, "world": 4,
                              "step": step, "t_start": time.time() - 1, "duration": 0.5,
                              "gpu": uuid, "phases": {"forward": 0.2, "backward": 0.25},
                              "memb": memb}
                    sock.sendto(json.dumps(record).encode(), str(process.socket_path))
            plain = {"v": 1, "kind": "step", "run": "plain", "rank": 0, "step": 0,
                     "duration": 0.5}
            sock.sendto(json.dumps(plain).encode(), str(process.socket_path))
        def arrived() -> bool:
            ranks = process.json("/api/v1/snapshot")[1]["ranks"]
            return len(ranks) == 3 and all(r["steps_total"] == 3 for r in ranks if r["run"] == "llm")

        wait_for(arrived, what="every record at the agent")
        yield process
    finally:
        process.stop()


def test_table_beside_the_projections(agent_with_a_run: AgentProcess) -> None:
    result = estimate("--from-run", "llm", "--url", agent_with_a_run.url)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "run llm, rank 1 of 4" in out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    # measured, then ZeRO-1/2/3 on the run's 4 GPUs (the estimator's GB, one decimal)
    assert lines["optimizer states"].split()[-8:] == ["84.0", "GB", "21.0", "GB", "21.0", "GB",
                                                      "21.0", "GB"]
    assert lines["gradients"].split()[-8:] == ["14.0", "GB", "14.0", "GB", "3.5", "GB", "3.5",
                                               "GB"]
    assert lines["total"].split()[-8:] == ["125.0", "GB", "62.0", "GB", "51.5", "GB", "41.0",
                                           "GB"]
    assert "total on 16 GPUs" in lines and lines["total on 16 GPUs"].split()[-2:] == ["20.0", "GB"]
    assert "GPU memory" in lines  # the simulated H100's capacity
    assert "fits with ZeRO-1 on 4 GPUs" in out


def test_json_and_a_tighter_gpu(agent_with_a_run: AgentProcess) -> None:
    result = estimate("--from-run", "llm", "--url", agent_with_a_run.url, "--gpu-memory", "45GB", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["world"] == 4 and data["measured"]["total"] == 125 * GB
    fits = {(p["stage"], p["gpus"]): p["fits"] for p in data["projections"]}
    assert fits[(1, 4)] is False and fits[(3, 4)] is True
    # the fewest GPUs first, then the lightest stage
    assert data["advice"][0] == "fits with ZeRO-3 on 4 GPUs (41.0 GB per GPU)"


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--from-run", "nope"], "run 'nope' is not reporting"),
     (["--from-run", "plain"], "sends no memory breakdown"),
     (["--from-run", "llm", "--params", "7B"], "leave out --params"),
     ([], "give --params")],
)
def test_clear_errors(agent_with_a_run: AgentProcess, args: list[str], message: str) -> None:
    result = estimate(*args, "--url", agent_with_a_run.url)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_an_absent_agent(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = estimate("--from-run", "llm", "--url", f"http://127.0.0.1:{port}")
    assert result.returncode == 1 and "cannot read" in result.stderr
    assert "Traceback" not in result.stderr
