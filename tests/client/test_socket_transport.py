"""The hook over a real Unix datagram socket: delivery, latency, absent/late/stuck agents, fork."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gpumon.client import StepMonitor
from gpumon.client.transport import UnixDatagramTransport
from gpumon.wire import MAX_DATAGRAM_BYTES
from tests.client.conftest import Receiver


def run_steps(mon: StepMonitor, count: int) -> None:
    for _ in range(count):
        with mon.step(samples=2):
            with mon.phase("forward"):
                pass
            with mon.phase("backward"):
                pass


def test_every_step_arrives_exactly_once(receiver: Receiver) -> None:
    mon = StepMonitor(run="sock", socket_path=str(receiver.path))
    run_steps(mon, 500)
    mon.close()
    steps = receiver.wait_for_steps(500)
    assert [s.step for s in steps] == list(range(500))
    assert len(receiver.hellos()) == 1
    assert receiver.rejected == []
    stats = mon.stats
    assert stats.records_sent == 501 and stats.dropped == {}
    assert stats.datagrams_sent > 1  # batches were split to fit the datagram limit


def test_socket_path_comes_from_the_environment(receiver: Receiver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("GPUMON_SOCKET", str(receiver.path))
    mon = StepMonitor(run="env")
    run_steps(mon, 3)
    mon.close()
    assert mon.socket_path == str(receiver.path)
    assert len(receiver.wait_for_steps(3)) == 3


def test_a_step_arrives_within_a_second_without_further_steps(receiver: Receiver) -> None:
    mon = StepMonitor(run="hang", socket_path=str(receiver.path))
    with mon.step():
        pass
    ended = time.monotonic()
    # No further step, no flush, no close: as if the next step hung.
    steps = receiver.wait_for_steps(1, timeout=1.0)
    assert len(steps) == 1
    assert receiver.arrivals[-1] - ended < 1.0
    mon.close()


def test_absent_agent_never_blocks_or_raises(tmp_path: Path) -> None:
    mon = StepMonitor(run="absent", socket_path=str(tmp_path / "no" / "such" / "dir" / "ingest.sock"))
    started = time.monotonic()
    run_steps(mon, 1000)
    loop_seconds = time.monotonic() - started
    mon.close()
    assert loop_seconds < 5.0  # generous: the loop itself takes milliseconds
    stats = mon.stats
    assert stats.records_sent == 0
    assert stats.dropped == {"no_agent": 1001}


def test_stale_socket_file_counts_as_absent_agent(socket_path: Path) -> None:
    receiver = Receiver(socket_path).start()
    receiver.stop()
    socket_path.touch()  # a file left behind, nobody bound
    transport = UnixDatagramTransport(str(socket_path))
    assert transport.send(b"{}") == "no_agent"
    transport.close()


def test_agent_that_starts_late_receives_later_steps_and_a_new_hello(socket_path: Path) -> None:
    mon = StepMonitor(run="late", socket_path=str(socket_path))
    run_steps(mon, 5)
    mon.flush()
    assert mon.stats.dropped == {"no_agent": 6}
    receiver = Receiver(socket_path).start()
    try:
        run_steps(mon, 5)
        mon.flush()
        mon.flush()  # the re-sent hello goes out with the next flush
        steps = receiver.wait_for_steps(5)
        assert [s.step for s in steps] == [5, 6, 7, 8, 9]
        deadline = time.monotonic() + 5  # the hello follows the steps, in a later datagram
        while not receiver.hellos() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert len(receiver.hellos()) == 1
    finally:
        mon.close()
        receiver.stop()


def test_agent_restart_is_found_again(socket_path: Path) -> None:
    first = Receiver(socket_path).start()
    mon = StepMonitor(run="restart", socket_path=str(socket_path))
    run_steps(mon, 3)
    mon.flush()
    assert len(first.wait_for_steps(3)) == 3
    first.stop()
    run_steps(mon, 2)  # lost while the agent is down
    mon.flush()
    second = Receiver(socket_path).start()
    try:
        run_steps(mon, 4)
        mon.close()
        assert [s.step for s in second.wait_for_steps(4)] == [5, 6, 7, 8]
        assert mon.stats.dropped == {"no_agent": 2}
    finally:
        second.stop()


def test_agent_that_never_reads_does_not_block_the_loop(socket_path: Path) -> None:
    stuck = Receiver(socket_path).start(read=False)
    try:
        mon = StepMonitor(run="stuck", socket_path=str(socket_path))
        slowest = 0.0
        for _ in range(40):
            for _ in range(500):
                started = time.perf_counter()
                with mon.step(), mon.phase("forward"):
                    pass
                slowest = max(slowest, time.perf_counter() - started)
            time.sleep(0.02)  # let the sender fill the socket's queue
        mon.close()
        stats = mon.stats
        assert slowest < 0.5  # generous: a step never waits on the socket
        assert stats.dropped.get("agent_busy", 0) > 0
        assert stats.records_sent + sum(stats.dropped.values()) == stats.steps + 1
    finally:
        stuck.stop()


def test_oversized_datagram_is_refused_not_raised(receiver: Receiver) -> None:
    transport = UnixDatagramTransport(str(receiver.path))
    assert transport.send(b"x" * (1 << 22)) in ("too_large", "agent_busy")
    assert transport.send(b"[]") is None
    transport.close()
    assert MAX_DATAGRAM_BYTES < (1 << 22)


def test_forked_child_does_not_send_for_the_parent(receiver: Receiver) -> None:
    mon = StepMonitor(run="fork", socket_path=str(receiver.path))
    run_steps(mon, 2)
    pid = os.fork()
    if pid == 0:  # the child: steps, a flush and a close must all stay silent
        try:
            run_steps(mon, 50)
            mon.flush()
            mon.close()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    run_steps(mon, 3)
    mon.close()
    steps = receiver.wait_for_steps(5)
    time.sleep(0.2)  # anything the child might have sent would have arrived by now
    assert [s.step for s in receiver.steps()] == [0, 1, 2, 3, 4]
    assert {s.pid for s in steps} == {os.getpid()}


def test_interpreter_exit_flushes_without_close(receiver: Receiver) -> None:
    script = (
        "import sys\n"
        "from gpumon.client import StepMonitor\n"
        f"mon = StepMonitor(run='exit', socket_path={str(receiver.path)!r})\n"
        "for _ in range(7):\n"
        "    with mon.step():\n"
        "        pass\n"
        "raise SystemExit('training crashed')\n"  # no close(): atexit must send the steps
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "training crashed" in out.stderr
    assert [s.step for s in receiver.wait_for_steps(7)] == list(range(7))
