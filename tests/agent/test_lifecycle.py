"""Agent lifecycle as a process: signals, reload, stale sockets, running unprivileged."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import bcrypt
import pytest

from tests.helpers import http_get, start_agent, values, wait_for


def step(run: str) -> bytes:
    return json.dumps({"v": 1, "kind": "step", "run": run, "rank": 0, "step": 0,
                       "duration": 0.1}).encode()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly(tmp_path: Path, sig: int) -> None:
    agent = start_agent(tmp_path, "--simulate", "2")
    assert agent.socket_path.exists()
    served = agent.scrape()  # the last scrape before the signal is whole
    assert "gpumon_gpu_up" in served
    assert agent.stop(sig) == 0
    assert not agent.socket_path.exists()
    assert "Traceback" not in agent.log()


def test_sighup_reloads_users_and_allow_list(tmp_path: Path) -> None:
    config = tmp_path / "gpumon.toml"
    config.write_text("[agent]\nsimulate = 1\n")
    agent = start_agent(tmp_path, "--config", str(config))
    try:
        # 1. Restrict senders to another uid: our steps are now refused and counted.
        config.write_text(f"[agent]\nsimulate = 1\nallowed_uids = [{os.getuid() + 4321}]\n"
                          "interval = 2.0\n")
        agent.process.send_signal(signal.SIGHUP)
        wait_for(lambda: "configuration reloaded" in agent.log(), what="reload logged")
        assert "interval: changed, takes effect after a restart" in agent.log()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(step("refused"), str(agent.socket_path))
        wait_for(lambda: values(agent.metrics(), "gpumon_ingest_dropped_total",
                                reason="uid_not_allowed"), what="refused sender counted")
        # 2. A broken config keeps the running one.
        config.write_text("[agent\n")
        agent.process.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed, keeping the running configuration" in agent.log())
        assert agent.process.poll() is None
        # 3. Basic auth switched on at run time.
        hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
        web = tmp_path / "web.yml"
        web.write_text(f"basic_auth_users:\n  prom: {hashed}\n")
        config.write_text(f'[agent]\nsimulate = 1\nweb_config = "{web}"\n')
        agent.process.send_signal(signal.SIGHUP)
        wait_for(lambda: http_get(agent.url + "/metrics")[0] == 401, what="auth enforced")
        assert http_get(agent.url + "/healthz")[0] == 200
    finally:
        assert agent.stop() == 0


def test_stale_socket_from_a_crashed_agent_is_replaced(tmp_path: Path) -> None:
    first = start_agent(tmp_path, "--simulate", "1")
    first.stop(signal.SIGKILL)
    assert first.socket_path.exists()  # left behind by the crash
    second = start_agent(tmp_path, "--simulate", "1", port=first.port)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(step("after-crash"), str(second.socket_path))
        wait_for(lambda: values(second.metrics(), "gpumon_steps_total", run="after-crash"))
    finally:
        second.stop()


def test_second_agent_on_the_same_socket_refuses_to_steal_it(tmp_path: Path) -> None:
    first = start_agent(tmp_path, "--simulate", "1")
    second = None
    try:
        # A later --socket wins over the helper's own.
        second = start_agent(tmp_path, "--simulate", "1", "--socket", str(first.socket_path))
        status, body = second.json("/readyz")
        assert body["status"] == "degraded"
        assert any("in use by another running agent" in p for p in body["problems"]), body
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(step("still-first"), str(first.socket_path))
        wait_for(lambda: values(first.metrics(), "gpumon_steps_total", run="still-first"))
    finally:
        if second is not None:
            second.stop()
        first.stop()
    assert not first.socket_path.exists()  # the second agent never removed it; the first did


def test_sighup_with_a_config_that_is_not_utf8_keeps_the_agent(tmp_path: Path) -> None:
    config = tmp_path / "gpumon.toml"
    web = tmp_path / "web.yml"
    web.write_text("")
    config.write_text(f'[agent]\nsimulate = 1\nweb_config = "{web}"\n')
    agent = start_agent(tmp_path, "--config", str(config))
    try:
        for broken, name in ((config, "config file"), (web, "web config")):
            original = broken.read_bytes()
            broken.write_bytes(original + b"# caf\xe9\n")  # Latin-1, as an editor may save it
            agent.process.send_signal(signal.SIGHUP)
            wait_for(lambda n=name, b=broken: f"{n} {b} is not valid UTF-8" in agent.log(),
                     what=f"{name} refused on reload")
            assert agent.process.poll() is None
            assert agent.socket_path.exists()
            assert http_get(agent.url + "/metrics")[0] == 200
            broken.write_bytes(original)
        assert "Traceback" not in agent.log()
    finally:
        assert agent.stop() == 0


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (the kernel's SigCgt mask)."""
    with open(f"/proc/{pid}/status") as status:
        mask = next(line for line in status if line.startswith("SigCgt:")).split()[1]
    return bool(int(mask, 16) >> (signum - 1) & 1)


def test_sighup_during_start_up_is_not_fatal(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, "--simulate", "1", wait_ready=False)
    try:
        wait_for(lambda: agent.process.poll() is not None or catches(agent.process.pid,
                                                                     signal.SIGHUP),
                 interval=0.001, what="a SIGHUP handler")
        # Caught from before the slow imports: the HTTP port is not even bound yet.
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", agent.port)) != 0
        for _ in range(5):  # a burst through the rest of the start-up
            agent.process.send_signal(signal.SIGHUP)
            time.sleep(0.02)
        wait_for(lambda: agent.process.poll() is None and _listening(agent.port)
                 and http_get(agent.url + "/readyz")[0] == 200, what="the agent serving")
        wait_for(lambda: "configuration reloaded" in agent.log(), what="the reload, after start")
    finally:
        assert agent.stop() == 0, agent.log()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0

