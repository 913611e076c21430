"""The hook over a real Unix datagram socket: delivery, absent/late/stuck agents, fork.

No figure here depends on how fast the machine is: that the loop never waits on the agent is
shown by which thread sends and by steps finished while a send is held; how long a step takes
beside a stuck agent and how soon a record arrives are measured by
``benchmarks/bench_client_latency.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpumon.client import StepMonitor
from gpumon.client.core.transport import UnixDatagramTransport
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
    assert stats.records_sent == 502 and stats.dropped == {}  # the hello, the finish
    assert stats.datagrams_sent > 1  # batches were split to fit the datagram limit


def test_socket_path_comes_from_the_environment(receiver: Receiver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("GPUMON_SOCKET", str(receiver.path))
    mon = StepMonitor(run="env")
    run_steps(mon, 3)
    mon.close()
    assert mon.socket_path == str(receiver.path)
    assert len(receiver.wait_for_steps(3)) == 3


class Watched:
    """Wraps a transport: notes which threads call ``send``; with ``hold``, a send waits until
    ``release`` is set (a transport stuck inside the kernel), or 30 s, and then sets it: a loop
    that waited for the send fails the test instead of hanging it."""

    def __init__(self, inner: UnixDatagramTransport, hold: bool = False) -> None:
        self.inner = inner
        self.threads: set[int] = set()
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def send(self, datagram: bytes) -> str | None:
        self.threads.add(threading.get_ident())
        self.entered.set()
        if not self.release.wait(30):
            self.release.set()  # held too long: whatever waited for it ran after the release
        return self.inner.send(datagram)

    def close(self) -> None:
        self.inner.close()


def test_a_step_arrives_without_further_steps(receiver: Receiver) -> None:
    mon = StepMonitor(run="hang", socket_path=str(receiver.path))
    with mon.step():
        pass
    # No further step, no flush, no close: as if the next step hung. The sender thread sends
    # it on its own (10 s: only a guard against waiting forever).
    steps = receiver.wait_for_steps(1, timeout=10.0)
    assert len(steps) == 1
    mon.close()


def test_absent_agent_never_blocks_or_raises(tmp_path: Path) -> None:
    transport = Watched(UnixDatagramTransport(str(tmp_path / "no" / "such" / "dir" / "ingest.sock")),
                        hold=True)
    mon = StepMonitor(run="absent", transport=transport)
    run_steps(mon, 1)
    assert transport.entered.wait(30)  # the sender thread is inside a send, held there
    run_steps(mon, 999)  # the loop goes on while it is held
    loop_ran_while_held = not transport.release.is_set()
    transport.release.set()
    assert loop_ran_while_held
    assert threading.get_ident() not in transport.threads  # only the sender thread sends
    mon.close()
    stats = mon.stats
    assert stats.records_sent == 0
    assert stats.dropped == {"no_agent": 1002}  # the hello, the finish


def test_stale_socket_file_counts_as_absent_agent(socket_path: Path) -> None:
    receiver = Receiver(socket_path).start()
    receiver.stop()
    socket_path.touch()  # a file left behind, nobody bound
    transport = UnixDatagramTransport(str(socket_path))
    assert transport.send(b"{}") == "no_agent"
    transport.close()


def test_agent_that_starts_late_receives_every_step_in_order_and_a_new_hello(
        socket_path: Path) -> None:
    mon = StepMonitor(run="late", socket_path=str(socket_path))
    run_steps(mon, 5)
    mon.flush()
    held = mon.stats
    assert held.dropped == {} and held.records_sent == 0
    assert held.backlog_records == 6 and held.backlog_bytes > 0  # the hello and 5 steps wait
    receiver = Receiver(socket_path).start()
    try:
        run_steps(mon, 5)
        mon.flush()
        mon.flush()  # the re-sent hello goes out with the next flush
        steps = receiver.wait_for_steps(10)
        assert [s.step for s in steps] == list(range(10))  # the backlog first, in order
        starts = [s.t_start for s in steps]
        assert starts == sorted(starts) and starts[4] < starts[5]  # their own timestamps
        deadline = time.monotonic() + 5  # the hello follows the steps, in a later datagram
        while len(receiver.hellos()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert len(receiver.hellos()) == 2  # the one that waited, and one for a new agent
        stats = mon.stats
        assert stats.dropped == {} and stats.backlog_records == 0 and stats.backlog_bytes == 0
        assert stats.late_records == 6
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
    run_steps(mon, 2)  # kept while the agent is down
    mon.flush()
    assert mon.stats.backlog_records == 2
    second = Receiver(socket_path).start()
    try:
        run_steps(mon, 4)
        mon.close()
        assert [s.step for s in second.wait_for_steps(6)] == [3, 4, 5, 6, 7, 8]
        assert mon.stats.dropped == {}
    finally:
        second.stop()


def test_agent_that_never_reads_does_not_block_the_loop(socket_path: Path) -> None:
    stuck = Receiver(socket_path).start(read=False)
    try:
        transport = Watched(UnixDatagramTransport(str(socket_path)))
        mon = StepMonitor(run="stuck", transport=transport)
        for _ in range(40):
            for _ in range(500):
                with mon.step(), mon.phase("forward"):
                    pass
            time.sleep(0.02)  # let the sender fill the socket's queue
        senders = set(transport.threads)
        mon.close()
        stats = mon.stats
        assert threading.get_ident() not in senders  # a step never sends: only the sender thread
        assert stats.dropped.get("agent_busy", 0) > 0
        assert stats.records_sent + sum(stats.dropped.values()) == stats.steps + 2
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
