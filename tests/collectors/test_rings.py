"""The agent's side of the step rings (``collectors/rings.py``, ``wire/ring.py``): a ring handed
over is kept, one per process and ``max_rings`` in all; what a sender should not pass is refused
by reason and closed; a drained ring gives exactly the steps that never arrived, each once; and
the rank store files them as their rank's even when a successor already sends for it."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumon.client.core.ring import StepRing
from gpumon.client.core.transport import UnixDatagramTransport
from gpumon.collectors.ingest import IngestServer
from gpumon.collectors.rings import MAX_RING_BYTES, RingKeeper
from gpumon.collectors.samples import SenderCredentials
from gpumon.state.ranks import RankStore
from gpumon.wire import StepRecord, decode_datagram
from gpumon.wire import ring as layout

ME = SenderCredentials(pid=os.getpid(), uid=os.getuid())
HANDOVER = layout.handover("r", 1)


class Dropped(Counter[str]):
    def __call__(self, reason: str, count: int) -> None:
        self[reason] += count


@pytest.fixture
def dropped() -> Dropped:
    return Dropped()


@pytest.fixture
def keeper(dropped: Dropped) -> Iterator[RingKeeper]:
    keeper = RingKeeper(max_rings=4, on_dropped=dropped)
    yield keeper
    keeper.close()


def closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def ring_with_steps(count: int, capacity: int = 16, sent: int = 0) -> StepRing:
    ring = StepRing(capacity=capacity)
    ring.set_unix_offset(1_700_000_000.0)
    for seq in range(count):
        t0 = 1000.0 + seq
        ring.write(seq, None, t0, t0 + 0.5, 8, None, None)
    ring.mark_sent(sent)
    return ring


def test_a_drained_ring_gives_the_steps_past_the_mark(keeper: RingKeeper, dropped: Dropped) -> None:
    ring = ring_with_steps(6, sent=2)
    keeper.take(HANDOVER, [os.dup(ring.fd)], ME)
    assert keeper.held == 1 and keeper.pids() == {ME.pid}
    [(records, sender)] = keeper.drain({ME.pid, 999_999})
    assert sender == ME
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert [s.step for s in steps] == [2, 3, 4, 5]
    assert all((s.run, s.rank, s.pid, s.samples, s.duration_s) == ("r", 1, ME.pid, 8, 0.5) for s in steps)
    assert steps[0].t_start == 1_700_000_000.0 + 1002.0
    assert keeper.held == 0 and keeper.recovered_total == 4 and not dropped
    assert keeper.drain({ME.pid}) == []  # drained once
    ring.close()


def test_steps_that_arrived_after_the_mark_are_not_taken_twice(keeper: RingKeeper) -> None:
    ring = ring_with_steps(6, sent=2)
    keeper.take(HANDOVER, [os.dup(ring.fd)], ME)
    # Steps 2 and 3 were sent, the process died before marking them.
    arrived = decode_datagram(b"[" + b",".join(
        layout.handover("x", 0)[:0] + _step_json(seq) for seq in (2, 3)) + b"]").records
    keeper.note(arrived, ME)
    [(records, _)] = keeper.drain({ME.pid})
    assert [r.step for r in records if isinstance(r, StepRecord)] == [4, 5]
    ring.close()


def _step_json(seq: int) -> bytes:
    import json

    return json.dumps({"v": 1, "kind": "step", "run": "r", "rank": 1, "step": seq, "duration": 0.5,
                       "t_start": 1_700_000_000.0 + 1000.0 + seq}).encode()


def test_a_ring_that_wrapped_gives_its_latest_steps(keeper: RingKeeper) -> None:
    ring = ring_with_steps(11, capacity=4)
    keeper.take(HANDOVER, [os.dup(ring.fd)], ME)
    [(records, _)] = keeper.drain({ME.pid})
    assert [r.step for r in records if isinstance(r, StepRecord)] == [7, 8, 9, 10]
    ring.close()


def test_a_ring_with_everything_sent_gives_nothing(keeper: RingKeeper) -> None:
    ring = ring_with_steps(5, sent=5)
    keeper.take(HANDOVER, [os.dup(ring.fd)], ME)
    assert keeper.drain({ME.pid}) == []
    assert keeper.drained_total == Counter(complete=1)
    ring.close()


def _memfd(name: str, content: bytes, size: int | None = None) -> int:
    fd = os.memfd_create(name)
    os.write(fd, content)
    if size is not None:
        os.ftruncate(fd, size)
    return fd


def _bad_header() -> bytes:
    return layout.HEADER.pack(layout.MAGIC, layout.VERSION, 0, layout.ENTRY.size, 0, 0, 0.0)


@pytest.mark.parametrize(("make", "data", "sender", "reason"), [
    (lambda: [os.pipe()[0]], HANDOVER, ME, "ring_not_memfd"),
    (lambda: [os.open(tempfile.mkstemp()[1], os.O_RDWR)], HANDOVER, ME, "ring_not_memfd"),
    (lambda: [_memfd("other", layout.header(16, 0.0), layout.ring_bytes(16))], HANDOVER, ME,
     "ring_not_memfd"),
    (lambda: [os.dup(StepRing(4).fd), os.dup(StepRing(4).fd)], HANDOVER, ME, "ring_fds"),
    (lambda: [os.dup(StepRing(4).fd)], b'{"v":1,"kind":"ring","run":"a b","rank":0}', ME,
     "ring_bad_datagram"),
    (lambda: [os.dup(StepRing(4).fd)], b"\xff", ME, "ring_bad_datagram"),
    (lambda: [os.dup(StepRing(4).fd)], HANDOVER, SenderCredentials(pid=None, uid=0), "ring_no_pid"),
    (lambda: [os.dup(StepRing(4).fd)], HANDOVER, SenderCredentials(pid=os.getpid(), uid=os.getuid() + 1),
     "ring_not_owner"),
    (lambda: [_memfd(layout.MEMFD_NAME, b"garbage" * 20)], HANDOVER, ME, "ring_garbage"),
    (lambda: [_memfd(layout.MEMFD_NAME, _bad_header(), 4096)], HANDOVER, ME, "ring_garbage"),
    (lambda: [_memfd(layout.MEMFD_NAME, b"short")], HANDOVER, ME, "ring_truncated"),
    (lambda: [_memfd(layout.MEMFD_NAME, layout.header(16, 0.0), 100)], HANDOVER, ME, "ring_truncated"),
    (lambda: [_memfd(layout.MEMFD_NAME, layout.header(16, 0.0), MAX_RING_BYTES + 1)], HANDOVER, ME,
     "ring_too_large"),
])
def test_what_a_sender_should_not_pass_is_refused_and_closed(keeper: RingKeeper, dropped: Dropped,
                                                             make: object, data: bytes,
                                                             sender: SenderCredentials,
                                                             reason: str) -> None:
    fds = make()  # type: ignore[operator]
    keeper.take(data, fds, sender)
    assert dict(dropped) == {reason: 1}
    assert keeper.held == 0
    assert all(closed(fd) for fd in fds)


def test_garbage_written_after_the_hand_over_is_refused_at_the_drain(keeper: RingKeeper,
                                                                    dropped: Dropped) -> None:
    ring = ring_with_steps(4)
    keeper.take(HANDOVER, [os.dup(ring.fd)], ME)
    layout.ENTRY.pack_into(ring.view, layout.HEADER.size + layout.ENTRY.size, 0, -1, 5.0, 1.0, -1, -1, 0.0)
    assert keeper.drain({ME.pid}) == []
    assert dict(dropped) == {"ring_garbage": 1} and keeper.held == 0
    # An entry the wire refuses (a day-long step) is dropped by the wire's reason, alone.
    ring2 = ring_with_steps(3)
    layout.ENTRY.pack_into(ring2.view, layout.HEADER.size, 0, -1, 1.0, 1.0 + 90_000, -1, -1, 0.0)
    keeper.take(HANDOVER, [os.dup(ring2.fd)], ME)
    [(records, _)] = keeper.drain({ME.pid})
    assert [r.step for r in records if isinstance(r, StepRecord)] == [1, 2]
    assert dropped["bad_value"] == 1
    ring.close()
    ring2.close()


def test_one_ring_per_process_and_a_cap_on_all(keeper: RingKeeper, dropped: Dropped) -> None:
    first = StepRing(4)
    first_fd = os.dup(first.fd)
    keeper.take(HANDOVER, [first_fd], ME)
    keeper.take(HANDOVER, [os.dup(first.fd)], ME)  # handed over again (an agent lost and back)
    assert keeper.held == 1 and closed(first_fd)
    rings = [StepRing(4) for _ in range(4)]
    fds = [os.dup(r.fd) for r in rings]
    for pid, fd in enumerate(fds, start=1):
        keeper.take(HANDOVER, [fd], SenderCredentials(pid=pid, uid=os.getuid()))
    assert keeper.held == 4 and dropped == Counter(ring_cap=1) and closed(fds[-1])
    keeper.forget([("r", 1)])  # the rank expired: its processes' rings go
    assert keeper.held == 0 and not any(closed(fd) is False for fd in fds)


def test_fds_through_the_real_socket_are_kept_or_closed(tmp_path: Path, dropped: Dropped) -> None:
    keeper = RingKeeper(4, dropped)
    records: list[object] = []
    server = IngestServer(tmp_path / "s.sock", lambda r, s: records.extend(r), dropped,
                          on_ring=keeper.take)
    server.start()
    before = len(os.listdir("/proc/self/fd"))
    try:
        ring = StepRing(8)
        transport = UnixDatagramTransport(str(tmp_path / "s.sock"))
        assert transport.send_fd(HANDOVER, ring.fd) is None
        # A step datagram carrying descriptors: refused whole, its descriptors closed.
        assert transport.send_fd(b"[" + _step_json(0) + b"]", ring.fd) is None
        # Too many descriptors for one datagram: the kernel closes those beyond, ingest the rest.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.sendmsg([HANDOVER], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                   struct.pack("8i", *[ring.fd] * 8))], 0, str(tmp_path / "s.sock"))
        sock.close()
        deadline = time.monotonic() + 5
        while sum(dropped.values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert keeper.held == 1 and records == []
        assert dropped == Counter(ring_fds=1, ring_bad_datagram=1)
        transport.close()
        ring.close()
        keeper.close()
        assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        server.stop()


def test_a_dead_processes_steps_are_its_ranks_while_a_successor_sends() -> None:
    alive = {200}
    store = RankStore(alive=lambda pid: pid in alive)
    now = time.time()

    def step(seq: int, pid: int) -> StepRecord:  # the successor's steps come later
        return StepRecord("r", 1, seq, 0.1, t_start=now - (1 if pid == 200 else 10) + seq * 0.1, pid=pid)

    old = SenderCredentials(pid=100, uid=0)
    new = SenderCredentials(pid=200, uid=0)
    assert len(store.ingest([step(0, 100), step(1, 100)], old, 1.0, now)) == 2
    assert len(store.ingest([step(0, 200)], new, 2.0, now)) == 1  # a restart: 100 has gone
    accepted = store.ingest([step(2, 100), step(3, 100)], old, 3.0, now, ended=True)
    assert len(accepted) == 2
    [rank] = store.ranks()
    assert (rank.run, rank.steps_total, rank.kernel_pid, rank.last_step) == ("r", 5, 200, 0)
    assert store.conflicts() == {}
    # Without ``ended`` the same records would be a second live job's (the hazard).
    store.ingest([step(4, 100)], old, 4.0, now)
    assert {r.run for r in store.ranks()} == {"r", "r:clash-100"}
