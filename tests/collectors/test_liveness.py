"""Seeing a training process end: /proc/PID/stat parsed, real processes started and ended."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from gpumon.collectors.liveness import ProcessLiveness, parse_stat


def test_the_stat_line_is_read_after_the_command_name_whatever_it_holds() -> None:
    fields = " ".join(["S"] + [str(i) for i in range(4, 30)])
    assert parse_stat(f"42 (a) b (c)) {fields}") == ("S", 22)
    assert parse_stat("42 (x") is None
    assert parse_stat("42 (x) S 1 2") is None


def test_a_process_that_exits_is_seen_to_have_ended_and_a_live_one_is_not() -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    short = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        liveness = ProcessLiveness()
        assert liveness.ended({live.pid, short.pid}) <= {short.pid}
        while short.poll() is None:  # a zombie until reaped: already ended
            time.sleep(0.01)
        assert liveness.ended({live.pid, short.pid}) == {short.pid}
    finally:
        live.kill()
        live.wait()
    assert liveness.ended({live.pid}) == {live.pid}


def test_a_pid_reused_by_another_process_has_ended(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    stat = proc / "77" / "stat"
    stat.parent.mkdir(parents=True)
    rest = " ".join(str(i) for i in range(4, 30))
    stat.write_text(f"77 (python) S {rest}")
    liveness = ProcessLiveness(proc)
    assert liveness.ended({77}) == set()
    stat.write_text(f"77 (python) S {rest.replace(' 22 ', ' 99 ')}")
    assert liveness.ended({77}) == {77}
    stat.write_text(f"77 (python) Z {rest}")
    assert ProcessLiveness(proc).ended({77}) == {77}
