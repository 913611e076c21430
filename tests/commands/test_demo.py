"""`gpumon demo`: starts agent, simulated node and job; logs or shows a live view; stops cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.commands.test_top import PtyProcess, row
from tests.helpers import ROOT, agent_env, free_port, http_get, parse_metrics, values, wait_for


def demo_command(port: int, socket_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "gpumon.cli", "demo", "--port", str(port), "--socket",
            str(socket_path), "--schedule", "short", "--gpus", "3", "--ranks", "2",
            "--interval", "0.25", *args]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_stops_cleanly_on_a_signal(tmp_path: Path, sig: signal.Signals) -> None:
    port = free_port()
    socket_path = tmp_path / "demo.sock"
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(demo_command(port, socket_path, "--no-ui", "--duration", "60"),
                                   stdout=out, stderr=subprocess.STDOUT, env=agent_env(), cwd=ROOT)
    try:
        def steps_flowing() -> bool:
            metrics = parse_metrics(http_get(f"http://127.0.0.1:{port}/metrics")[1].decode())
            return len(values(metrics, "gpumon_steps_total", run="demo")) == 2
        wait_for(steps_flowing, timeout=30, what="steps from both ranks")
        assert socket_path.exists()
        children = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(sig)
        code = process.wait(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert code == 0, text
    assert not socket_path.exists()
    assert not [c for c in children if c.is_running()]
    assert "phase 1/7 compute (6 s): compute-bound" in text
    assert "gpumon demo: stopped;" in text
    assert "Traceback" not in text


def test_demo_logs_one_line_per_phase_when_not_on_a_terminal(tmp_path: Path) -> None:
    port = free_port()
    result = subprocess.run(demo_command(port, tmp_path / "d.sock", "--duration", "13.5"),
                            capture_output=True, text=True, env=agent_env(), cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("gpumon demo: 3 simulated NVIDIA H100 80GB HBM3, 2 ranks of run 'demo'; "
                        "built-in schedule 'short': 7 phases, 50 s, repeating")
    assert lines[1].startswith(f"gpumon demo: metrics http://127.0.0.1:{port}/metrics")
    phases = [line for line in lines if "] phase " in line]
    assert [p.split("] ")[1].split(" (")[0] for p in phases] == [
        "phase 1/7 compute", "phase 2/7 input", "phase 3/7 communication"]
    # Each line tells what the agent concluded while the previous phase ran.
    assert phases[0].endswith("since the previous line (steps): none yet")
    assert "(steps): compute " in phases[1]
    assert "input " in phases[2].rsplit("(steps): ", 1)[1]
    assert lines[-1].startswith("gpumon demo: stopped; ")
    # It ends by pointing at the page of its own run, made from what it recorded.
    assert lines[-1].endswith(f"; the run in pictures: {tmp_path / 'd.html'} "
                              f"(recorded in {tmp_path / 'd.jsonl'})")
    page = (tmp_path / "d.html").read_text()
    assert "<h1>gpumon report: demo</h1>" in page and "over 2 ranks" in page
    assert "\x1b[" not in result.stdout  # no live view, no colour codes in a pipe
    assert not (tmp_path / "d.sock").exists()


def test_demo_live_view_in_a_terminal(tmp_path: Path) -> None:
    demo = PtyProcess(demo_command(0, tmp_path / "t.sock", "--duration", "30"))
    try:
        screen = demo.wait_for(
            lambda text: row(text.rsplit("phase 1/7", 1)[-1], "demo", "1", "stepping", "1"),
            30, "a frame with rank 1 on GPU 1")
        frame = screen.rsplit("phase 1/7", 1)[-1]
        assert frame.startswith(" compute (")
        assert row(frame, "2", "NVIDIA H100 80GB HBM3")
        assert "metrics http://127.0.0.1:" in frame and "Ctrl-C stops" in frame
    finally:
        code = demo.stop(signal.SIGINT)
    assert code == 0, demo.output[-2000:]
    assert "gpumon demo: stopped;" in demo.output
    assert not (tmp_path / "t.sock").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "2", "--ranks", "3"], "3 ranks on 2 GPUs"),
    (["--schedule", "nope.toml"], "cannot read schedule nope.toml"),
    (["--gpu-model", "a100"], "unknown GPU model 'a100'; choose from h100-sxm, h200-sxm"),
])
def test_demo_refuses_bad_options(args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "demo", *args],
                            capture_output=True, text=True, env=agent_env(), cwd=ROOT, timeout=30)
    assert result.returncode == 2
    assert result.stderr.startswith("gpumon: error: ") and message in result.stderr


def test_demo_reports_a_busy_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(demo_command(port, tmp_path / "b.sock", "--no-ui"),
                                capture_output=True, text=True, env=agent_env(), cwd=ROOT,
                                timeout=30)
    assert result.returncode == 1
    assert f"{port}" in result.stderr and "gpumon: error:" in result.stderr
    assert not (tmp_path / "b.sock").exists()
