"""`gpumon agent` as a process: its main loop under a storm of signals; once its flags are
parsed it is the agent alone, in the same process, with every signal still handled."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.helpers import http_get, start_agent, wait_for


def test_a_storm_of_sighups_never_wedges_the_main_loop(tmp_path: Path) -> None:
    # A handler that set a threading.Event deadlocked when a signal landed while the main
    # loop held that event's lock (in wait() or clear()): the agent went on serving, but no
    # reload or shutdown ran again.
    config = tmp_path / "gpumon.toml"
    config.write_text("[agent]\nsimulate = 1\n")
    agent = start_agent(tmp_path, "--config", str(config))
    try:
        for k in range(200):
            agent.process.send_signal(signal.SIGHUP)
            time.sleep((k % 7) * 0.0005)  # 0-3 ms apart: some land inside the loop's wait
        time.sleep(0.5)
        config.write_text(f"[agent]\nsimulate = 1\nallowed_uids = [{os.getuid() + 4321}]\n")
        agent.process.send_signal(signal.SIGHUP)
        wait_for(lambda: f"allowed_uids: [{os.getuid() + 4321}]" in agent.log(),
                 what="the reload after the storm")
    finally:
        assert agent.stop() == 0, agent.log()[-2000:]


def _ready(url: str) -> bool:
    try:
        return http_get(url + "/readyz", timeout=2.0)[0] == 200
    except OSError:
        return False


def _status_mask(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith(field)).split()[1], 16)


def test_the_serving_agent_no_longer_carries_the_command_line(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, "--simulate", "1")
    try:
        pid = agent.process.pid  # the process the caller started, and signals, is the agent
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        assert any(arg.endswith(b"gpumon/agent/__main__.py") for arg in argv), argv
        assert b"--simulate" not in argv  # parsed: the flags came over as JSON
        with open(f"/proc/{pid}/maps") as maps:
            assert "pydantic_core" not in maps.read()  # the parser's compiled dependency
        assert not _status_mask(pid, "SigBlk:") & (1 << (signal.SIGHUP - 1))
    finally:
        assert agent.stop() == 0, agent.log()[-2000:]


def test_signals_while_the_command_line_hands_over_are_all_handled(tmp_path: Path) -> None:
    # From the command line's first handler to the agent serving, a SIGHUP every few ms:
    # one landing between the exec and the agent's own handlers is held (blocked, pending)
    # and handled once they are in place; none is fatal.
    agent = start_agent(tmp_path, "--simulate", "1", wait_ready=False)
    try:
        wait_for(lambda: agent.process.poll() is not None
                 or bool(_status_mask(agent.process.pid, "SigCgt:") & (1 << (signal.SIGHUP - 1))),
                 interval=0.001, what="the command line's SIGHUP handler")
        sent = 0
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and agent.process.poll() is None:
            agent.process.send_signal(signal.SIGHUP)
            sent += 1
            time.sleep(0.003)
            if sent % 20 == 0 and _ready(agent.url):
                break
        assert agent.process.poll() is None, agent.log()[-2000:]
        assert _ready(agent.url), agent.log()[-2000:]
        wait_for(lambda: "configuration reloaded" in agent.log(), what="a reload")
    finally:
        assert agent.stop() == 0, agent.log()[-2000:]
