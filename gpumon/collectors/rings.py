"""The step rings the training processes hand over (``gpumon.wire.ring``): one memory file per
process, kept here until the process ends, then read for the steps it had not sent.

A process's last steps are the ones its sender had not sent yet when it died (``os._exit``, a
SIGKILL, a segfault): still in the hook's buffer or its backlog. They are also the most telling
records of the run. Each process writes every completed step into its ring as the step ends and
its sender marks in it how far it has sent; the agent holds a descriptor of the file (sent
with SCM_RIGHTS), so the memory outlives the process, and once the process is seen to have
ended its unsent entries become its step records (``drain``), de-duplicated against what did
arrive: the mark is written just after each send, so a step sent in that gap is recognised
by the last record that came from the process.

Whatever a sender hands over is checked before it is kept, and refused with a counted reason
otherwise, its descriptors closed: one descriptor per datagram, from a process the agent can
see, with a valid ``ring`` datagram; a memory file made as a ring (its name), owned by the
sending user, of a ring's size, with a ring's header. The agent never maps it (a file that
shrank would fault the reader) but reads it with ``pread``, bounded. At most one ring per
process and ``max_rings`` in all (the rank store's cap on live pairs); a ring is closed when
drained, when its rank expires, or when its process hands over a new one.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpumon.collectors.samples import SenderCredentials
from gpumon.wire import ProtocolError, Record, StepRecord, decode_record
from gpumon.wire import ring as layout

log = logging.getLogger(__name__)

MAX_RING_BYTES = layout.ring_bytes(layout.MAX_CAPACITY)
"""The largest file kept (and the most read of one)."""
DUPLICATE_WINDOW_S = 1.0
"""A ring entry with the step number of the last record received from its process and an end
within this of it is that record (the two clocks' offsets differ by microseconds)."""

OnDropped = Callable[[str, int], None]
RankKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class HeldRing:
    """A descriptor the agent keeps, and whose steps the ring holds."""

    fd: int
    run: str
    rank: int
    uid: int | None


class RingKeeper:
    """The rings of live processes, by pid; thread-safe (ingest hands them over, housekeeping
    drains them)."""

    def __init__(self, max_rings: int, on_dropped: OnDropped) -> None:
        self.max_rings = max_rings
        self._on_dropped = on_dropped
        self._lock = threading.Lock()
        self._rings: dict[int, HeldRing] = {}
        self._last: dict[int, tuple[int, float | None]] = {}  # pid -> its last step received
        self.recovered_total = 0
        """Step records read from the rings of ended processes."""
        self.drained_total: Counter[str] = Counter()
        """Rings read, by outcome (``recovered``: steps found past the mark, ``complete``:
        everything had been sent, or the drop reason)."""

    @property
    def held(self) -> int:
        """Descriptors held now."""
        with self._lock:
            return len(self._rings)

    def pids(self) -> set[int]:
        """The processes whose rings are held (whose ends the agent must watch for)."""
        with self._lock:
            return set(self._rings)

    def take(self, data: bytes, fds: list[int], sender: SenderCredentials) -> None:
        """A datagram that came with descriptors: keep the ring it hands over, or close every
        descriptor and count why not. Never raises."""
        try:
            reason, held = self._check(data, fds, sender)
        except Exception:  # a bug here must cost the ring, never ingest or a descriptor
            log.exception("ingest: unexpected error checking a step ring")
            reason, held = "internal_error", None
        if held is None or sender.pid is None:
            _close(fds)
            self._on_dropped(reason or "ring_refused", 1)
            return
        with self._lock:
            old = self._rings.get(sender.pid)
            full = old is None and len(self._rings) >= self.max_rings
            if not full:
                self._rings[sender.pid] = held  # a process's newer ring replaces its older
        if full:
            _close(fds)
            self._on_dropped("ring_cap", 1)
        elif old is not None:
            _close([old.fd])

    def _check(self, data: bytes, fds: list[int],
               sender: SenderCredentials) -> tuple[str | None, HeldRing | None]:
        if len(fds) != 1:
            return "ring_fds", None
        if sender.pid is None:
            return "ring_no_pid", None  # its end could never be seen
        try:
            run, rank = layout.parse_handover(data)
        except layout.RingError as exc:
            return exc.reason, None
        fd = fds[0]
        info = os.fstat(fd)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if not stat.S_ISREG(info.st_mode) or not target.startswith(f"/memfd:{layout.MEMFD_NAME}"):
            return "ring_not_memfd", None
        if sender.uid is not None and info.st_uid != sender.uid:
            return "ring_not_owner", None
        if info.st_size > MAX_RING_BYTES:
            return "ring_too_large", None
        try:
            capacity, _, _ = layout.read_header(os.pread(fd, layout.HEADER.size, 0))
        except layout.RingError as exc:
            return exc.reason, None
        if info.st_size < layout.ring_bytes(capacity):
            return "ring_truncated", None
        return None, HeldRing(fd, run, rank, sender.uid)

    def note(self, records: Iterable[Record], sender: SenderCredentials) -> None:
        """Steps accepted from ``sender``: the last is where its ring's unsent steps begin
        at the latest (called for each datagram; a dict lookup unless it holds a ring)."""
        pid = sender.pid
        if pid is None or pid not in self._rings:
            return
        last = None
        for record in records:
            if isinstance(record, StepRecord):
                last = record
        if last is not None:
            self._last[pid] = (last.step, last.t_end)

    def drain(self, pids: Iterable[int]) -> list[tuple[list[Record], SenderCredentials]]:
        """The ended processes ``pids``: the steps their rings hold that never arrived, each
        process's as its records (with the sender it handed the ring over as); their rings
        are closed."""
        taken: list[tuple[int, HeldRing, tuple[int, float | None] | None]] = []
        with self._lock:
            for pid in pids:
                held = self._rings.pop(pid, None)
                if held is not None:
                    taken.append((pid, held, self._last.pop(pid, None)))
        out: list[tuple[list[Record], SenderCredentials]] = []
        for pid, held, last in taken:
            try:
                records = self._read(pid, held, last)
            except Exception:
                log.exception("reading the step ring of process %d", pid)
                records = []
                self._on_dropped("internal_error", 1)
            finally:
                _close([held.fd])
            if records:
                out.append((records, SenderCredentials(pid=pid, uid=held.uid)))
        return out

    def _read(self, pid: int, held: HeldRing,
              last: tuple[int, float | None] | None) -> list[Record]:
        try:
            data = os.pread(held.fd, MAX_RING_BYTES, 0)
            contents = layout.parse(data)
        except OSError:
            self._count("ring_unreadable")
            return []
        except layout.RingError as exc:
            self._count(exc.reason)
            return []
        wire = [layout.step_wire(e, held.run, held.rank, pid, contents.unix_offset)
                for e in contents.unsent]
        if last is not None:
            wire = wire[_after(wire, last):]
        records: list[Record] = []
        for obj in wire:
            try:
                records.append(decode_record(obj))
            except ProtocolError as exc:
                self._on_dropped(exc.reason, 1)
        with self._lock:
            self.recovered_total += len(records)
            self.drained_total["recovered" if records else "complete"] += 1
        if records:
            log.info("run %r rank %d: %d step(s) of ended process %d read from its ring",
                     held.run, held.rank, len(records), pid)
        return records

    def _count(self, reason: str) -> None:
        self._on_dropped(reason, 1)
        with self._lock:
            self.drained_total[reason] += 1

    def forget(self, keys: Iterable[RankKey]) -> None:
        """Ranks that expired or were evicted: the rings of their processes are closed."""
        gone = set(keys)
        if not gone:
            return
        with self._lock:
            pids = [pid for pid, held in self._rings.items() if (held.run, held.rank) in gone]
            closing = [self._rings.pop(pid).fd for pid in pids]
            for pid in pids:
                self._last.pop(pid, None)
        _close(closing)

    def close(self) -> None:
        """Close every ring (the agent stops: a restarted agent is handed them again)."""
        with self._lock:
            closing = [held.fd for held in self._rings.values()]
            self._rings.clear()
            self._last.clear()
        _close(closing)


def _after(wire: list[dict[str, object]], last: tuple[int, float | None]) -> int:
    """How many of the entries ``wire`` (oldest first) the agent already has: up to the one
    that is the last step it received from the process, if one is."""
    step, t_end = last
    for i in range(len(wire) - 1, -1, -1):
        entry = wire[i]
        if entry["step"] != step:
            continue
        end = float(entry["t_start"]) + float(entry["duration"])  # type: ignore[arg-type]
        if t_end is None or (math.isfinite(end) and abs(end - t_end) <= DUPLICATE_WINDOW_S):
            return i + 1
    return 0


def _close(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
