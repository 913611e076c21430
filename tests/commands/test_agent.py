"""`gpumon agent` as a process: its main loop under a storm of signals."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.helpers import start_agent, wait_for


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
