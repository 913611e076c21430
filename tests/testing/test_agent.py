"""The harness's real agent and loopback helpers: what tests and benchmarks rely on."""

from __future__ import annotations

import http.server
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumon.testing import agent_env, free_port, http_get, start_agent, value, values, wait_for


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        status = int(self.path.strip("/") or 200)
        body = f"status {status}".encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_http_get_returns_error_statuses_and_raises_on_refusal(server: str) -> None:
    assert http_get(server + "/200") == (200, b"status 200")
    assert http_get(server + "/503") == (503, b"status 503")
    assert http_get(server + "/404")[0] == 404
    with pytest.raises(OSError):
        http_get(f"http://127.0.0.1:{free_port()}/", timeout=2)


def test_wait_for_returns_the_truthy_result_or_fails_with_the_last() -> None:
    calls = iter([0, None, "ready"])
    assert wait_for(lambda: next(calls), timeout=5, interval=0.01) == "ready"

    def refused() -> bool:
        raise ConnectionRefusedError("not yet")

    with pytest.raises(AssertionError, match="waiting for the thing.*not yet"):
        wait_for(refused, timeout=0.2, interval=0.05, what="the thing")


def test_agent_env_drops_gpumon_settings_and_names_only_the_fake_library(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUMON_PORT", "1")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/lib/real-driver")
    monkeypatch.setenv("FAKE_NVML_SCENARIO", "/stale.scn")
    bare = agent_env()
    assert "GPUMON_PORT" not in bare and "FAKE_NVML_SCENARIO" not in bare
    assert bare["LD_LIBRARY_PATH"] == ""
    fake = agent_env(tmp_path, tmp_path / "x.scn", extra={"GPUMON_INTERVAL": "2"})
    assert fake["LD_LIBRARY_PATH"] == str(tmp_path)
    assert fake["FAKE_NVML_SCENARIO"] == str(tmp_path / "x.scn")
    assert fake["GPUMON_INTERVAL"] == "2" and "GPUMON_PORT" not in fake


def test_start_agent_runs_a_real_agent_until_stopped(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, "--interval", "0.5")
    try:
        assert agent.socket_path.parent == tmp_path
        wait_for(agent.socket_path.exists, timeout=10, what="the ingest socket")
        status, ready = agent.json("/readyz")
        assert status == 200, ready
        metrics = agent.metrics()
        assert value(metrics, "gpumon_nvml_up") == 0  # agent_env() loads no NVML at all
        assert values(metrics, "gpumon_agent_info") == [1.0]
    finally:
        code = agent.stop()
    assert code == 0, agent.log()
    assert agent.process.poll() == 0


def test_start_agent_fails_with_the_agents_log(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="(?s)did not become ready.*interval=-1"):
        start_agent(tmp_path, "--interval", "-1")


def test_stop_kills_an_agent_that_ignores_sigterm_with_its_process_group(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, new_session=True)
    assert os.getpgid(agent.process.pid) == agent.process.pid
    os.kill(agent.process.pid, signal.SIGSTOP)  # a stopped process never handles SIGTERM
    assert agent.stop(timeout=0.5) == -signal.SIGKILL
