"""The step ring on the client's side: both cores write each completed step into it as it
ends, exactly as they buffer it; the sender hands its descriptor over and marks how far it
has sent, so that what the agent reads from it after a crash is exactly what it never got."""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import pytest

from gpumon.client.core import ring as client_ring
from gpumon.client.core import step_core
from gpumon.client.core.ring import StepRing, open_ring
from gpumon.client.core.sender import Sender
from gpumon.client.core.step_tuple import SEQ, T0, T1
from gpumon.client.core.transport import MemoryTransport
from gpumon.wire import HelloRecord, StepRecord
from gpumon.wire import ring as layout

_hook = pytest.importorskip("gpumon.client.core._hook")

CORES = [pytest.param(step_core.HookCore, id="python"), pytest.param(_hook.HookCore, id="c")]

STEPS: list[dict[str, Any]] = [
    {},
    {"step": 7, "samples": 32, "tokens": 4096, "flops": 1.5e12},
    {"step": -3, "samples": True, "tokens": 2.5, "flops": 10**400},  # none of them storable
    {"step": 2**63, "samples": -1, "flops": 12},
    {"samples": 8},
]


def _core(base: type, buffer: deque[Any]) -> Any:
    return base(buffer, lambda: None, lambda exc, step: None, lambda name: False)


def _contents(ring: StepRing) -> layout.RingContents:
    return layout.parse(bytes(ring.view))


def _drive(base: type, ring: StepRing, steps: list[dict[str, Any]]) -> deque[Any]:
    buffer: deque[Any] = deque()
    core = _core(base, buffer)
    core.set_ring(ring)
    for kwargs in steps:
        with core.step(**kwargs):
            with core.phase("forward"):
                pass
    core.set_ring(None)
    return buffer


@pytest.mark.parametrize("base", CORES)
def test_each_completed_step_is_in_the_ring_as_buffered(base: type) -> None:
    ring = StepRing(capacity=16)
    buffer = _drive(base, ring, STEPS)
    contents = _contents(ring)
    assert contents.written == len(STEPS) and contents.sent == 0
    assert [(e.seq, e.t0, e.t1) for e in contents.unsent] == [(t[SEQ], t[T0], t[T1]) for t in buffer]
    assert [(e.step, e.samples, e.tokens, e.flops) for e in contents.unsent] == [
        (None, None, None, None), (7, 32, 4096, 1.5e12), (None, None, None, None),
        (None, None, None, 12.0), (None, 8, None, None)]
    ring.close()


def test_both_cores_write_the_same_entries() -> None:
    entries = []
    for base in (step_core.HookCore, _hook.HookCore):
        ring = StepRing(capacity=16)
        _drive(base, ring, STEPS)
        entries.append([(e.seq, e.step, e.samples, e.tokens, e.flops) for e in _contents(ring).unsent])
        ring.close()
    assert entries[0] == entries[1]


@pytest.mark.parametrize("base", CORES)
def test_the_ring_keeps_the_latest_steps_when_it_wraps(base: type) -> None:
    ring = StepRing(capacity=4)
    _drive(base, ring, [{"step": i} for i in range(11)])
    contents = _contents(ring)
    assert contents.written == 11
    assert [e.step for e in contents.unsent] == [7, 8, 9, 10]


@pytest.mark.parametrize("base", CORES)
def test_a_stopped_core_writes_nothing(base: type) -> None:
    ring = StepRing(capacity=4)
    core = _core(base, deque())
    core.set_ring(ring)
    core.stop()  # a forked child's, or a closed monitor's
    with core.step():
        pass
    assert _contents(ring).written == 0


class FdTransport(MemoryTransport):
    """Keeps datagrams, and the descriptors handed over with ``send_fd``."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[tuple[bytes, int]] = []

    def send_fd(self, datagram: bytes, fd: int) -> str | None:
        if self.fail_with is not None:
            return self.fail_with
        self.handed.append((datagram, fd))
        return None


def _sender(transport: FdTransport, ring: StepRing, buffer: deque[Any]) -> Sender:
    hello = HelloRecord("ringrun", 3, 4, 3, os.getpid())
    return Sender(transport, hello, buffer, ring=ring)


def _steps(sender: Sender, core: Any, count: int) -> None:
    for _ in range(count):
        with core.step():
            pass


def test_the_sender_hands_the_ring_over_and_marks_what_it_sent() -> None:
    ring = StepRing(capacity=64)
    buffer: deque[Any] = deque()
    core = _core(_hook.HookCore, buffer)
    core.set_ring(ring)
    transport = FdTransport()
    sender = _sender(transport, ring, buffer)
    try:
        _steps(sender, core, 5)
        sender.flush()
        assert len(transport.handed) == 1
        datagram, fd = transport.handed[0]
        assert layout.parse_handover(datagram) == ("ringrun", 3)
        assert fd == ring.fd
        contents = _contents(ring)
        assert contents.sent == 5 and contents.unsent == []
        assert [r.step for r in transport.records() if isinstance(r, StepRecord)] == [0, 1, 2, 3, 4]

        # An agent that cannot take them: the mark stays, the ring holds what is unsent.
        transport.fail_with = "agent_busy"
        _steps(sender, core, 3)
        sender.flush()
        assert [e.seq for e in _contents(ring).unsent] == [5, 6, 7]

        # An agent gone and back (a restart): the ring is handed over again, then sent.
        transport.fail_with = "no_agent"
        sender.flush()
        transport.fail_with = None
        sender.flush()
        assert len(transport.handed) == 2
        assert _contents(ring).unsent == [] and _contents(ring).sent == 8
    finally:
        core.set_ring(None)
        sender.close()


def test_a_steps_unix_start_is_the_one_sent() -> None:
    ring = StepRing(capacity=8)
    buffer: deque[Any] = deque()
    core = _core(_hook.HookCore, buffer)
    core.set_ring(ring)
    transport = FdTransport()
    transport.fail_with = "agent_busy"
    sender = _sender(transport, ring, buffer)
    try:
        _steps(sender, core, 2)
        sender.flush()
        contents = _contents(ring)
        transport.fail_with = None
        sender.flush()
        sent = [r for r in transport.records() if isinstance(r, StepRecord)]
        for entry, record in zip(contents.unsent, sent, strict=True):
            assert record.t_start == pytest.approx(entry.t0 + contents.unix_offset, abs=1e-3)
            assert record.duration_s == pytest.approx(entry.t1 - entry.t0, rel=1e-6)
    finally:
        core.set_ring(None)
        sender.close()


def test_gpumon_ring_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMON_RING", "0")
    assert open_ring() is None
    monkeypatch.setenv("GPUMON_RING", "1")
    ring = open_ring()
    assert ring is not None
    assert os.readlink(f"/proc/self/fd/{ring.fd}").startswith(f"/memfd:{layout.MEMFD_NAME}")
    ring.close()
    assert client_ring.enabled()


def test_each_datagram_is_marked_with_its_last_step() -> None:
    from gpumon.client.core.sender import _marks

    datagrams = [(b"", 2), (b"", 2), (b"", 3), (b"", 1)]
    # three records without a step (hello, events), then steps 4..8 (ends 5..9)
    assert _marks(datagrams, 3, [5, 6, 7, 8, 9]) == [None, 5, 8, 9]
    assert _marks([(b"", 2)], 2, []) == [None]
    assert _marks([(b"", 1), (b"", 1)], 0, [1, 2]) == [1, 2]
