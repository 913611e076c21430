"""The command line: bad input gets one clear error line and a non-zero exit; help, choices
and completion read as a user expects."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import get_args

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
        f"gpumon: error: config file {config}: interval=-1: must be between 0.05 and 86400 "
        "seconds"]


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


COMMANDS = ("agent", "doctor", "estimate", "classify", "demo", "top")


def test_short_help_and_readable_metavars() -> None:
    for command in ("", *COMMANDS):
        result = run_cli(*([command] if command else []), "-h")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"Usage: gpumon {command}".rstrip())
        for typed in ("<str>", "<int>", "<float>", "<list", "range>", "<text>"):
            assert typed not in result.stdout, (command, typed)


def test_choices_are_real_choices_shown_in_help() -> None:
    estimate_help = run_cli("estimate", "-h").stdout
    for shown in ("<fp16|bf16|fp32>", "<adam|adamw|sgd|sgd_momentum>", "<none|selective|full>"):
        assert shown in estimate_help
    assert "<debug|info|warning|error>" in run_cli("agent", "-h").stdout
    result = run_cli("estimate", "--params", "7B", "--recompute", "some")
    assert result.returncode == 2
    assert "'some' is not one of 'none', 'selective', 'full'" in result.stderr


def test_the_listed_choices_are_the_ones_the_code_takes() -> None:
    from gpumon import cli
    from gpumon.agent.config import COLLECTORS, LOG_LEVELS
    from gpumon.analysis import estimate, memory

    assert get_args(cli.Precision) == get_args(memory.Precision)
    assert get_args(cli.Recompute) == get_args(memory.Recompute)
    assert get_args(cli.Optimizer) == get_args(estimate.OptimizerName)
    assert get_args(cli.LogLevel) == LOG_LEVELS
    assert tuple(c.value for c in cli.Collector) == COLLECTORS


def complete(words: str) -> list[str]:
    env = {**agent_env(), "_GPUMON_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split(" ")) - 1)}
    result = subprocess.run([sys.executable, "-m", "gpumon.cli"], capture_output=True,
                            text=True, timeout=30, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_shell_completion() -> None:
    assert complete("gpumon ag") == ["agent"]
    assert complete("gpumon estimate --precision ") == ["fp16", "bf16", "fp32"]
    # --show-completion names the shell it runs under, found from its parent processes: run
    # it from bash (kept as its parent by the command after it), whatever started this test.
    script = subprocess.run(["bash", "-c", '"$0" -m gpumon.cli --show-completion; exit $?',
                             sys.executable], capture_output=True, text=True, timeout=30,
                            env=agent_env(), cwd=ROOT)
    assert script.returncode == 0 and "_gpumon_completion" in script.stdout, script.stderr
