"""The ingest socket handed over by the service manager: a real agent started by systemd's
``systemd-socket-activate`` takes over the socket it bound, counts what was sent before the
agent ran, and leaves the socket in place when it stops; a socket of the wrong kind or at
another path is refused with a message that says so."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumon.collectors.socket_activation import ActivationError, inherited_socket
from gpumon.testing import agent_env, free_port, http_get, parse_metrics, value, wait_for
from gpumon.testing.agent import IMPORT_ROOT
from gpumon.testing.services import require_tool
from gpumon.wire import StepRecord, encode_record


def test_no_variables_means_no_inherited_socket() -> None:
    assert inherited_socket("/run/x.sock", environ={}) is None


def test_variables_meant_for_another_process_are_ignored_and_removed() -> None:
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "ingest"}
    assert inherited_socket("/run/x.sock", environ=env, pid=2) is None
    assert env == {}


def test_a_count_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ActivationError, match="LISTEN_FDS='x' is not a number"):
        inherited_socket("/run/x.sock", environ={"LISTEN_PID": "7", "LISTEN_FDS": "x"}, pid=7)


def activated(tmp_path: Path, listen: list[str],
              socket_path: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    """``gpumon agent --socket SOCKET_PATH`` under ``systemd-socket-activate LISTEN``."""
    require_tool("systemd-socket-activate")
    port = free_port()
    env = agent_env()
    env["PYTHONPATH"] = str(IMPORT_ROOT)
    passed = [f"--setenv={k}={v}" for k, v in env.items() if k not in ("HOME", "TERM", "PATH")]
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            ["systemd-socket-activate", *listen, *passed, sys.executable, "-m", "gpumon.cli", "agent",
             "--address", "127.0.0.1", "--port", str(port), "--socket", str(socket_path)],
            stdout=out, stderr=subprocess.STDOUT, cwd=IMPORT_ROOT)
    return process, port, log


def step(n: int) -> bytes:
    record = StepRecord(run="act", rank=0, step=n, t_start=time.time() - 0.01, duration_s=0.01)
    return b"[" + encode_record(record) + b"]"


def test_the_agent_takes_over_the_socket_and_counts_what_waited_in_its_queue(tmp_path: Path) -> None:
    path = tmp_path / "ingest.sock"
    process, port, log = activated(tmp_path, ["--datagram", f"--listen={path}"], path)
    try:
        wait_for(path.exists, timeout=10, what="the socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            for n in range(5):  # the first starts the agent; all wait while it starts
                sender.sendto(step(n), str(path))
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_get(url + "/readyz")[0] == 200, timeout=30, what="readiness")

        def counted() -> float:
            metrics = parse_metrics(http_get(url + "/metrics")[1].decode())
            return value(metrics, "gpumon_steps_total", run="act", rank="0")

        wait_for(lambda: counted() == 5, timeout=10, what="the 5 steps")
    finally:
        process.terminate()
        assert process.wait(30) == 0
    text = log.read_text()
    assert "(held by the service manager)" in text
    assert 'final gpumon_steps_total{run="act",rank="0"} 5' in text
    assert path.exists()  # the service manager's socket, not the agent's to remove


def test_a_stream_socket_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "ingest.sock"
    process, port, log = activated(tmp_path, [f"--listen={path}"], path)
    try:
        wait_for(path.exists, timeout=10, what="the socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))  # starts the agent
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: "AF_UNIX SOCK_DGRAM" in log.read_text(), timeout=30, what="the error")
            status, body = http_get(url + "/readyz")
            assert b"SOCK_STREAM" in body, (status, body)
    finally:
        process.terminate()
        process.wait(30)


def test_a_socket_at_another_path_is_refused_naming_both(tmp_path: Path) -> None:
    other, wanted = tmp_path / "other.sock", tmp_path / "ingest.sock"
    process, _, log = activated(tmp_path, ["--datagram", f"--listen={other}"], wanted)
    try:
        wait_for(other.exists, timeout=10, what="the socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"", str(other))
        wait_for(lambda: f"none bound to {wanted}" in log.read_text(), timeout=30, what="the error")
        assert str(other) in log.read_text()
        assert not wanted.exists()  # no socket quietly bound beside the handed-over one
    finally:
        process.terminate()
        process.wait(30)
