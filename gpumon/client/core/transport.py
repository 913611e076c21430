"""How datagrams leave the training process: a non-blocking Unix socket, or memory for tests."""

from __future__ import annotations

import array
import errno
import socket
from typing import Protocol

from gpumon.wire import Record, decode_datagram

SEND_FAILURES = ("no_agent", "agent_busy", "too_large", "permission_denied", "send_error")
"""What ``Transport.send`` may return instead of ``None``."""


class Transport(Protocol):
    """Sends one datagram; returns ``None`` when sent, else a reason from ``SEND_FAILURES``."""

    def send(self, datagram: bytes) -> str | None: ...

    def close(self) -> None: ...


class UnixDatagramTransport:
    """Sends to the agent's Unix datagram socket and never blocks or raises.

    Every send addresses the socket by path, so an agent that starts late or restarts (and
    binds a new socket file) is found again without reconnect logic.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None

    def send(self, datagram: bytes) -> str | None:
        """Send one datagram without blocking; a failure is returned, not raised."""
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(datagram, self.path)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            return "no_agent"  # no socket file, or a stale one nobody reads
        except BlockingIOError:
            return "agent_busy"  # the agent's receive queue is full
        except PermissionError:
            return "permission_denied"
        except OSError as err:
            if err.errno == errno.ENOBUFS:
                return "agent_busy"
            if err.errno == errno.EMSGSIZE:
                return "too_large"
            return "send_error"
        return None

    def send_fd(self, datagram: bytes, fd: int) -> str | None:
        """Send one datagram carrying ``fd`` (SCM_RIGHTS: the agent gets its own descriptor
        of the same file); a failure is returned, not raised."""
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendmsg([datagram], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             array.array("i", [fd]))], 0, self.path)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            return "no_agent"
        except BlockingIOError:
            return "agent_busy"
        except PermissionError:
            return "permission_denied"
        except OSError as err:
            return "agent_busy" if err.errno == errno.ENOBUFS else "send_error"
        return None

    def close(self) -> None:
        """Release the socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class MemoryTransport:
    """Keeps datagrams in a list, for tests; set ``fail_with`` to a reason to refuse sends."""

    def __init__(self) -> None:
        self.datagrams: list[bytes] = []
        self.fail_with: str | None = None
        self.closed = False

    def send(self, datagram: bytes) -> str | None:
        """Keep the datagram, or refuse it with ``fail_with``."""
        if self.fail_with is not None:
            return self.fail_with
        self.datagrams.append(datagram)
        return None

    def close(self) -> None:
        """Mark closed."""
        self.closed = True

    def records(self) -> list[Record]:
        """Every valid record received so far, decoded as the agent would."""
        return [r for d in self.datagrams for r in decode_datagram(d).records]
