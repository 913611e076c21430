"""An agent upgrade under a running job loses nothing: a real 2-rank DDP job (gloo, under
torchrun) runs under ``gpumon run`` while its agent is restarted twice (SIGTERM, a new agent
3 s later), on each of the two paths that keep the steps sent meanwhile:

* ``inherited``: ``systemd-socket-activate`` holds the socket (as a ``gpumon.socket`` unit
  would) and ``gpumon.testing.socket_holder`` plays the service manager restarting the
  service on it; the steps wait in the kernel's queue and the hook's backlog.
* ``backlog``: each agent binds its own socket (as a pod does on a hostPath); the hook keeps
  what it could not send while no agent listened, and sends it to the next.

Ground truth is what the job counted itself (its optimizer steps, one step each under
``gpumon run``). Each agent is scraped just before its SIGTERM, and logs the counts it reached
once ingest has drained (``final gpumon_steps_total{...}``): the sum of those over the three
agents must be the job's count, and their recordings must hold every step of each rank exactly
once. In every scrape the job's ranks are ``stepping``, never stalled or exited.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumon.testing import agent_env, free_port, http_get, parse_metrics, series, start_agent, wait_for
from gpumon.testing.agent import IMPORT_ROOT
from gpumon.testing.processes import kill_tree
from gpumon.testing.services import require_tool
from gpumon.testing.socket_holder import HeldSocket
from tests.e2e.distributed import JOBS, ROOT

pytestmark = pytest.mark.slow

RUN = "upgrade"
GAP_S = 3.0
FINAL = re.compile(r'final gpumon_steps_total\{run="([^"]+)",rank="(\d+)"\} (\d+)')


class Agents:
    """Starts and stops the agents of one path; each with its own port, log and recording."""

    def __init__(self, tmp_path: Path, held: HeldSocket | None) -> None:
        self.tmp_path = tmp_path
        self.socket = tmp_path / "ingest.sock"
        self.held = held
        self.started = 0
        self.url = ""
        self.log = tmp_path / "agent.log"
        self._stop: Callable[[], int] = lambda: 0

    def start(self) -> None:
        port = free_port()
        self.started += 1
        self.log = self.tmp_path / f"agent{self.started}.log"
        args = ["--interval", "0.5", "--record", str(self.recording(self.started))]
        if self.held is None:
            agent = start_agent(self.tmp_path, *args, port=port, socket_path=self.socket,
                                log_path=self.log)
            self._stop = agent.stop
        else:
            self.held.start([sys.executable, "-m", "gpumon.cli", "agent", "--address", "127.0.0.1",
                             "--port", str(port), "--socket", str(self.socket), *args], self.log)
            self._stop = self.held.stop
        self.url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(self.url + "/readyz") == 200, timeout=30, what="agent readiness")

    def recording(self, index: int) -> Path:
        return self.tmp_path / f"recording{index}.jsonl"

    def steps(self) -> dict[int, float]:
        """rank -> gpumon_steps_total of the run, in one scrape that also checks the ranks'
        state: stepping, never stalled or exited."""
        status, body = http_get(self.url + "/metrics")
        assert status == 200
        metrics = parse_metrics(body.decode())
        for labels, on in series(metrics, "gpumon_rank_state", run=RUN):
            assert on == (1.0 if labels["state"] == "stepping" else 0.0), (labels, on)
        for labels, stalled in series(metrics, "gpumon_rank_stalled_seconds", run=RUN):
            assert stalled == 0.0, labels
        return {int(labels["rank"]): v for labels, v in series(metrics, "gpumon_steps_total", run=RUN)}

    def stop(self) -> dict[int, int]:
        """SIGTERM the agent; the counts it logged once it had drained its socket."""
        assert self._stop() == 0, self.log.read_text()[-3000:]
        adopted = "(held by the service manager)" in self.log.read_text()
        assert adopted == (self.held is not None), self.log.read_text()[-3000:]
        final = {int(rank): int(count) for run, rank, count in FINAL.findall(self.log.read_text())
                 if run == RUN}
        assert final, self.log.read_text()[-3000:]
        return final


def _get(url: str) -> int:
    try:
        return http_get(url, timeout=2.0)[0]
    except OSError:
        return 0


def _job(agents: Agents, tmp_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("GPUMON_RUN", "GPUMON_SOCKET", "GPUMON_PURE_PYTHON", "GPUMON_RUN_DISABLE"):
        env.pop(name, None)
    command = [sys.executable, "-m", "gpumon.cli", "run", "--run", RUN, "--socket", str(agents.socket),
               "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), str(JOBS / "upgrade_job.py"),
               "--out", str(tmp_path / "out"), "--stop-file", str(tmp_path / "stop")]
    with open(tmp_path / "job.log", "wb") as log:
        return subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True, stdout=log,
                                stderr=subprocess.STDOUT)


def _recorded(path: Path) -> list[tuple[int, int]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(s["rank"], s["step"]) for s in lines if s.get("kind") == "step" and s.get("run") == RUN]


@pytest.mark.parametrize("path", ["inherited", "backlog"])
def test_two_agent_restarts_under_a_ddp_job_lose_no_step(tmp_path: Path, path: str) -> None:
    held = None
    if path == "inherited":
        require_tool("systemd-socket-activate")
        env = agent_env()
        env["PYTHONPATH"] = str(IMPORT_ROOT)
        held = HeldSocket(tmp_path / "ingest.sock", env, IMPORT_ROOT)
    agents = Agents(tmp_path, held)
    job = None
    try:
        agents.start()
        job = _job(agents, tmp_path)
        finals: list[dict[int, int]] = []
        for _ in range(2):
            wait_for(lambda: min(agents.steps().values() or [0]) >= 10 and len(agents.steps()) == 2,
                     timeout=120, what="steps of both ranks")
            before = agents.steps()  # the last scrape before the SIGTERM
            final = agents.stop()
            assert all(final[rank] >= before[rank] for rank in before), (final, before)
            finals.append(final)
            time.sleep(GAP_S)
            assert job.poll() is None, "the job ended while the agent was away"
            agents.start()
        wait_for(lambda: min(agents.steps().values() or [0]) >= 10 and len(agents.steps()) == 2,
                 timeout=60, what="steps of both ranks after the second restart")
        (tmp_path / "stop").touch()
        assert job.wait(60) == 0, (tmp_path / "job.log").read_text()[-4000:]
        finals.append(agents.stop())
    finally:
        if job is not None and job.poll() is None:
            kill_tree(job.pid)
        if held is not None:
            held.close()
    made = {rank: json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())["optimizer_steps"]
            for rank in (0, 1)}
    counted = {rank: sum(final.get(rank, 0) for final in finals) for rank in (0, 1)}
    assert counted == made, (finals, made)
    recorded = [step for index in (1, 2, 3) for step in _recorded(agents.recording(index))]
    assert sorted(recorded) == [(rank, step) for rank in (0, 1) for step in range(made[rank])]
    # Every agent after the first received steps made while no agent was up.
    assert all(final[rank] > 0 for final in finals for rank in (0, 1)), finals
