"""Ingest collector: receives step records from training processes on a Unix datagram socket.

The socket is created 0660 in a directory the agent makes if needed, and given a group
(``socket_group``, by default ``gpumon`` when that group exists) so that training jobs not
running as the agent's user can send: an agent started as root would otherwise make it
root:root, and every non-root job's records would be refused by the kernel, unseen by the
agent. A stale socket file left by a crashed agent is replaced only when nobody answers on
it. The kernel tells us each sender's pid and uid (SCM_CREDENTIALS), so senders can be
restricted by uid and a record's pid cannot be forged.

A datagram may also carry descriptors (SCM_RIGHTS): a process handing over its step ring
(``rings.py``). Those go to ``on_ring``, which keeps or closes them; every other path closes
what a datagram carried, so a sender can never leave a descriptor open in the agent.

Where the service manager holds the socket (``deploy/systemd/gpumon.socket``), the agent takes
it over instead (``socket_activation``) and leaves it in place when it stops: what is sent
while the agent restarts waits in the kernel's queue for the next one.
"""

from __future__ import annotations

import array
import errno
import grp
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue

from gpumon.collectors.samples import SenderCredentials
from gpumon.collectors.socket_activation import ActivationError, inherited_socket
from gpumon.errors import GpumonError
from gpumon.wire import MAX_DATAGRAM_BYTES, Record, decode_datagram

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
DEFAULT_SOCKET_GROUP = "gpumon"
RECEIVE_BUFFER_BYTES = 8 * 1024 * 1024
QUEUE_DATAGRAMS = 4096  # at most ~32 MiB of undecoded datagrams
PRESSURE_DATAGRAMS = QUEUE_DATAGRAMS // 2
"""With this many datagrams queued, the decoder is behind: while it stays behind, each sending
process may queue ``PROCESS_SHARE_DATAGRAMS`` more, so that one process's flood cannot fill
the queue and lose another process's steps."""
PROCESS_SHARE_DATAGRAMS = 1536
"""A process alone can fill the queue to 3,584 datagrams (bursts of one busy node's ranks
fit); the last 512 stay for the others (up to 60 steps each)."""
PRESSURE_SENDERS_MAX = 4096
"""Processes counted while the decoder is behind; datagrams from more are refused."""
MAX_PASSED_FDS = 4
"""Descriptors read from one datagram: a ring hand-over has one; the kernel closes those beyond
(and says so with MSG_CTRUNC), so none is ever left open in the agent."""
_CREDENTIALS = struct.Struct("iII")  # struct ucred: pid, uid, gid
_ANCILLARY_BYTES = socket.CMSG_SPACE(_CREDENTIALS.size) + socket.CMSG_SPACE(4 * MAX_PASSED_FDS)

OnRecords = Callable[[list[Record], SenderCredentials], None]
OnDropped = Callable[[str, int], None]
OnRing = Callable[[bytes, list[int], SenderCredentials], None]
OnSettled = Callable[[], None]


@dataclass(frozen=True)
class IngestStatus:
    """Whether the socket receives, and who may send to it (its group and mode)."""

    path: str
    up: bool
    mode: int | None = None
    group: str | None = None
    rings_held: int = 0
    """Step rings of live processes held (``rings.py``)."""
    ring_records_total: int = 0
    """Steps read from the rings of ended processes."""


class IngestError(GpumonError, RuntimeError):
    """The ingest socket cannot be created; the message says why."""


def socket_group_id(group: str | None) -> int | None:
    """The gid to give the socket: ``group`` (name or number), else the ``gpumon`` group
    if this node has one, else None (the socket keeps the agent's own group)."""
    try:
        if group is None:
            return grp.getgrnam(DEFAULT_SOCKET_GROUP).gr_gid
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        if group is None:
            return None
        raise IngestError(f"no such group {group!r} for the ingest socket") from None


def bind_socket(path: Path, gid: int | None = None) -> socket.socket:
    """Create, bind, chmod and (with ``gid``) chgrp the datagram socket, replacing a stale
    file safely."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise IngestError(f"cannot create socket directory {path.parent}: "
                          f"{exc.strerror or exc}") from exc
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        _receive_options(sock)
        old_umask = os.umask(0o117)  # the file is born 0660: no window where others can send
        try:
            sock.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, SOCKET_MODE)
    except OSError as exc:
        sock.close()
        raise IngestError(f"cannot bind ingest socket {path}: {exc.strerror or exc}") from exc
    if gid is not None:
        try:
            os.chown(path, -1, gid)
        except OSError as exc:
            sock.close()
            path.unlink(missing_ok=True)
            raise IngestError(f"cannot give ingest socket {path} to group {gid}: "
                              f"{exc.strerror or exc}") from exc
    return sock


def _receive_options(sock: socket.socket) -> None:
    """Ask for each sender's credentials, and a receive buffer for bursts."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
    except OSError:
        pass  # the kernel caps it at rmem_max; the default still works


def adopt_or_bind(path: Path, gid: int | None = None) -> tuple[socket.socket, bool]:
    """(the socket, whether the service manager handed it over): the inherited socket bound
    to ``path`` where there is one, else one bound here (``bind_socket``)."""
    try:
        sock = inherited_socket(str(path))
    except ActivationError as exc:
        raise IngestError(str(exc)) from None
    if sock is None:
        return bind_socket(path, gid), False
    try:
        _receive_options(sock)
    except OSError as exc:
        sock.close()
        raise IngestError(f"cannot receive credentials on the inherited socket {path}: "
                          f"{exc.strerror or exc}") from exc
    sock.setblocking(True)
    return sock, True


def _remove_stale(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise IngestError(f"cannot inspect {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISSOCK(mode):
        raise IngestError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)  # a crashed agent's leftover: nobody is bound to it
        return
    except OSError as exc:
        raise IngestError(f"cannot probe {path}: {exc.strerror or exc}") from exc
    finally:
        probe.close()
    raise IngestError(f"{path} is in use by another running agent")


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _credentials(ancillary: list[tuple[int, int, bytes]]) -> tuple[int, int] | None:
    """The sender's (pid, uid) from SCM_CREDENTIALS, when the kernel attached them."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS \
                and len(data) >= _CREDENTIALS.size:
            pid, uid, _gid = _CREDENTIALS.unpack_from(data)
            return pid, uid
    return None


def passed_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors a datagram carried (SCM_RIGHTS), now open in this process."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[:len(data) - len(data) % 4]))
    return fds


def close_fds(fds: list[int]) -> None:
    """Close descriptors a datagram carried that nobody keeps."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def parse_sender(ancillary: list[tuple[int, int, bytes]]) -> SenderCredentials:
    """The sender's pid/uid from SCM_CREDENTIALS, when the kernel attached them."""
    found = _credentials(ancillary)
    return SenderCredentials() if found is None else SenderCredentials(pid=found[0] or None,
                                                                       uid=found[1])


class IngestServer:
    """Receives datagrams until stopped; decoding errors are counted, never raised.

    Two threads: a receiver that only moves datagrams from the kernel into a bounded queue,
    and a decoder. The kernel queues very few datagrams per Unix socket
    (net.unix.max_dgram_qlen, often 10), so the receiver must get back to recv() within a
    millisecond or two even while records are being decoded or a scrape is rendered. Once
    the decoder is behind (half the queue full), each sending process gets a bounded share
    of what is left, so one process's flood does not cost another process a step.

    ``on_settled`` is called on the decoder's thread when it has handed records on and found
    the queue empty: a burst (say, every rank's step) has been taken in whole.
    """

    def __init__(self, path: Path, on_records: OnRecords, on_dropped: OnDropped,
                 allowed_uids: tuple[int, ...] = (), group: str | None = None,
                 on_ring: OnRing | None = None, on_settled: OnSettled | None = None) -> None:
        self.path = path
        self._on_records = on_records
        self._on_settled = on_settled
        self._unsettled = False  # records handed on since on_settled was last called
        self._on_dropped = on_dropped
        self._on_ring = on_ring
        self._allowed = frozenset(allowed_uids)
        # blocking: the receiver sleeps until a datagram or stop()
        self._sock, self.inherited = adopt_or_bind(path, socket_group_id(group))
        info = path.stat()
        self.socket_mode = stat.S_IMODE(info.st_mode)
        self.socket_group = _group_name(info.st_gid)
        self._stop_event = threading.Event()
        # C-level put and blocking get: no Python lock work per datagram on either thread.
        self._queue: SimpleQueue[tuple[bytes, list[tuple[int, int, bytes]], int] | None] = \
            SimpleQueue()
        self._receiver = threading.Thread(target=self._receive, name="gpumon-ingest-recv",
                                          daemon=True)
        self._decoder = threading.Thread(target=self._decode, name="gpumon-ingest",
                                         daemon=True)
        self.datagrams_total = 0

    def status(self) -> IngestStatus:
        """The socket as bound: receiving, with its group and mode."""
        return IngestStatus(str(self.path), True, self.socket_mode, self.socket_group)

    def set_allowed_uids(self, uids: tuple[int, ...]) -> None:
        """Change which users may send (SIGHUP); empty allows everyone who can write."""
        self._allowed = frozenset(uids)

    def start(self) -> None:
        """Start receiving and decoding."""
        self._receiver.start()
        self._decoder.start()

    def _receive(self) -> None:
        receive = self._sock.recvmsg
        queue = self._queue
        # While the decoder is behind: datagrams queued since, per sending pid (else None).
        behind: dict[int, int] | None = None
        while True:
            try:
                item = receive(MAX_DATAGRAM_BYTES + 1, _ANCILLARY_BYTES)
            except OSError as exc:
                if self._stop_event.is_set() or exc.errno == errno.EBADF:
                    break
                log.warning("ingest receive failed: %s", exc)
                self._on_dropped("receive_error", 1)
                continue
            if not item[0] and self._stop_event.is_set():
                break  # stop()'s shutdown, once what the kernel held has been read
            queued = queue.qsize()
            if queued < PRESSURE_DATAGRAMS:
                behind = None
            elif queued >= QUEUE_DATAGRAMS:
                self._on_dropped("agent_overloaded", 1)  # bounded memory under a flood
                close_fds(passed_fds(item[1]))
                continue
            else:
                if behind is None:
                    behind = {}
                pid = (_credentials(item[1]) or (0, 0))[0]
                held = behind.get(pid, 0)
                if held >= PROCESS_SHARE_DATAGRAMS or (
                        not held and len(behind) >= PRESSURE_SENDERS_MAX):
                    self._on_dropped("agent_overloaded_process", 1)
                    close_fds(passed_fds(item[1]))
                    continue
                behind[pid] = held + 1
            queue.put(item[:3])

    def _decode(self) -> None:
        get = self._queue.get
        empty = self._queue.empty
        while True:
            if self._unsettled and empty():
                self._settled()
            item = get()
            if item is None:  # stop(): everything queued before it has been handled
                break
            data, ancillary, flags = item
            self.datagrams_total += 1
            try:
                self._handle(data, ancillary, flags)
            except Exception:  # one bad datagram must never stop ingestion
                log.exception("ingest: unexpected error handling a datagram")
                self._on_dropped("internal_error", 1)

    def _handle(self, data: bytes, ancillary: list[tuple[int, int, bytes]], flags: int) -> None:
        fds = passed_fds(ancillary)
        if flags & socket.MSG_TRUNC or len(data) > MAX_DATAGRAM_BYTES:
            close_fds(fds)
            self._on_dropped("too_large", 1)
            return
        sender = parse_sender(ancillary)
        if self._allowed and (sender.uid is None or sender.uid not in self._allowed):
            close_fds(fds)
            self._on_dropped("uid_not_allowed", 1)
            return
        if fds or flags & socket.MSG_CTRUNC:  # a ring hand-over, or descriptors to refuse
            if self._on_ring is None or flags & socket.MSG_CTRUNC:
                close_fds(fds)
                self._on_dropped("ring_fds" if self._on_ring else "ring_unexpected", 1)
            else:
                self._on_ring(data, fds, sender)
            return
        result = decode_datagram(data)
        for reason in result.rejected:
            self._on_dropped(reason, 1)
        if result.records:
            self._on_records(result.records, sender)
            self._unsettled = self._on_settled is not None

    def _settled(self) -> None:
        self._unsettled = False
        assert self._on_settled is not None
        try:
            self._on_settled()
        except Exception:
            log.exception("ingest: unexpected error in on_settled")

    def stop(self) -> None:
        """Stop receiving, finish what was queued and close the socket. A socket bound here
        is removed (senders see "no agent" from then on, and keep their backlog); one the
        service manager holds stays, with what arrives from now on queued for the next agent."""
        self._stop_event.set()
        if self.inherited:
            self._wake_receiver()
        else:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove %s: %s", self.path, exc)
            # Wakes the receiver, which blocks in recvmsg() with no timeout: it reads what the
            # kernel still holds, then end-of-file; nothing more can arrive. (Never on a
            # shared socket: the shutdown would be the next agent's too.)
            self._sock.shutdown(socket.SHUT_RD)
        if self._receiver.is_alive():
            self._receiver.join(timeout=2.0)
        self._queue.put(None)  # after what the receiver queued
        if self._decoder.is_alive():
            self._decoder.join(timeout=5.0)
        self._sock.close()

    def _wake_receiver(self) -> None:
        """An empty datagram to the socket, behind what it already holds: the receiver reads
        up to it and stops (empty datagrams carry no records, so a sender's costs nothing)."""
        waker = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            waker.settimeout(2.0)  # a full queue empties as the receiver reads on
            waker.sendto(b"", str(self.path))
        except OSError as exc:
            log.warning("could not wake the ingest receiver on %s: %s", self.path, exc)
        finally:
            waker.close()
