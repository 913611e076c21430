"""Bad input on the command line gets one clear error line and a non-zero exit."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, agent_env, free_port


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumon.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=agent_env(), cwd=ROOT)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


def test_help_lists_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("agent", "doctor"):
        assert command in result.stdout


def test_unknown_flag() -> None:
    result = run_cli("agent", "--prot", "9403")
    assert result.returncode == 2
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "No such option: --prot" in errors[0], result.stderr


def test_bad_flag_value() -> None:
    result = run_cli("agent", "--port", "99999", "--simulate", "1")
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "gpumon: error: port=99999: must be between 0 and 65535"]


def test_bad_config_file(tmp_path: Path) -> None:
    config = tmp_path / "gpumon.toml"
    config.write_text("[agent]\ninterval = -1\n")
    result = run_cli("agent", "--config", str(config))
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "gpumon: error: interval=-1: must be between 0.05 and 86400 seconds"]


def test_port_in_use(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        result = run_cli("agent", "--simulate", "1", "--address", "127.0.0.1",
                         "--port", str(port), "--socket", str(tmp_path / "s.sock"))
    assert result.returncode == 1
    assert error_lines(result.stderr) == [
        f"gpumon: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert not (tmp_path / "s.sock").exists()


def test_config_file_that_is_not_utf8(tmp_path: Path) -> None:
    config = tmp_path / "gpumon.toml"
    config.write_bytes(b"[agent]\n# r\xe9seau\nport = 9500\n")
    result = run_cli("agent", "--config", str(config))
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        f"gpumon: error: config file {config} is not valid UTF-8 (byte 11: invalid "
        "continuation byte)"]
    assert "Traceback" not in result.stderr
