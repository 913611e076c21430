"""What the agent loses without the host's pids (Kubernetes' ``hostPID: false``), measured: one
sender reports the same steps to two agents, one in the sender's pid namespace and one in a pid
namespace of its own (``unshare --pid``, as a container without hostPID has), and exits.

Only the first is given the sender's pid by the kernel, so only it can name the rank's user,
read its process's CPU and see it exit; docs/security.md writes the trade down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumon.collectors.process_owner import user_name
from tests.helpers import AgentProcess, agent_env, free_port, http_get, values, wait_for

# It sends its steps, then lives on until its stdin closes: what the agents see of a live
# process is looked at while it certainly lives, however slowly this machine runs the test.
SENDER = """
import json, socket, sys, time
paths = sys.argv[1:]
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    for step in range(15):
        datagram = json.dumps({"v": 1, "kind": "step", "run": "pids", "rank": 0, "step": step,
                               "duration": 0.1}).encode()
        for path in paths:
            s.sendto(datagram, path)
        time.sleep(0.1)
sys.stdin.read()
"""


def _unshare() -> list[str]:
    command = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
               "--kill-child=SIGTERM"]
    try:
        ok = subprocess.run([*command, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("cannot make a user and pid namespace here (unshare)")
    return command


def _agent(tmp_path: Path, name: str, prefix: list[str]) -> AgentProcess:
    port, socket_path, log_path = free_port(), tmp_path / f"{name}.sock", tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "gpumon.cli", "agent", "--address", "127.0.0.1",
             "--port", str(port), "--socket", str(socket_path), "--collector", "host",
             "--collector", "ingest", "--collector", "owners"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=agent_env(),
            cwd=Path(__file__).resolve().parents[2])
    agent = AgentProcess(process, port, socket_path, log_path)
    wait_for(lambda: process.poll() is None and http_get(agent.url + "/readyz")[0] == 200,
             timeout=20, what=f"{name} agent ready")
    return agent


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[tuple[AgentProcess, AgentProcess]]:
    prefix = _unshare()
    started: list[AgentProcess] = []
    try:
        started.append(_agent(tmp_path, "host-pids", []))
        started.append(_agent(tmp_path, "own-pids", prefix))
        yield started[0], started[1]
    finally:
        for agent in started:
            # unshare --fork ignores SIGTERM while it waits: the agent inside is told directly.
            children = Path(f"/proc/{agent.process.pid}/task/{agent.process.pid}/children")
            if agent is not started[0] and not children.exists():  # no children list here
                agent.kill()
                continue
            inner = children.read_text().split() if children.exists() else []
            for pid in inner:
                os.kill(int(pid), signal.SIGTERM)
            assert (agent.process.wait(10) if inner else agent.stop()) == 0, agent.log()


@pytest.mark.slow
def test_only_the_agent_that_sees_the_senders_pid_names_its_user_and_sees_it_exit(
        agents: tuple[AgentProcess, AgentProcess]) -> None:
    host, own = agents
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(host.socket_path),
                               str(own.socket_path)], stdin=subprocess.PIPE)
    user = user_name(os.getuid())
    # While it runs: the rank's process and its owner, seen by the first agent only.
    wait_for(lambda: values(host.metrics(), "gpumon_rank_info", run="pids", user=user,
                            pid=str(sender.pid)), timeout=12, what="the sender's owner")
    wait_for(lambda: values(host.metrics(), "gpumon_process_cpu_seconds_total", run="pids"),
             timeout=12, what="the sender's CPU")
    wait_for(lambda: values(own.metrics(), "gpumon_steps_total", run="pids") == [15.0],
             timeout=12, what="every step at the other agent")
    sender.stdin.close()
    assert sender.wait(10) == 0
    wait_for(lambda: values(host.metrics(), "gpumon_rank_state", run="pids", state="exited") == [1],
             timeout=12, what="the exit seen")
    seen = own.metrics()
    report = {
        "host_pids": {"user": user, "pid": str(sender.pid), "process_cpu": True, "exit": True},
        "own_pids": {
            "rank_info": [dict(labels) for (name, labels) in seen
                          if name == "gpumon_rank_info"],
            "process_cpu": bool(values(seen, "gpumon_process_cpu_seconds_total", run="pids")),
            "exit": values(seen, "gpumon_rank_state", run="pids", state="exited")},
    }
    print(json.dumps(report, default=str))
    # The agent in its own pid namespace got the same steps, and nothing about their process.
    assert values(seen, "gpumon_steps_total", run="pids") == [15.0]
    assert values(seen, "gpumon_rank_info", run="pids", pid="", user="")
    assert not values(seen, "gpumon_process_cpu_seconds_total", run="pids")
    assert values(seen, "gpumon_rank_state", run="pids", state="exited") == [0.0]
