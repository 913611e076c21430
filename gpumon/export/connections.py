"""Bounds on the HTTP server's connections: how many at once, and how long each may take.

A thread per connection with no cap let 3,000 slow connections hold 737 threads and 33 MiB,
and a client trickling a byte every few seconds never hit the per-read timeout. Here:

* at most ``MAX_CONNECTIONS`` are served at once. When full, a new connection takes the
  place of the oldest one that has not yet sent its request (a scraper sends its request
  at once, so the ones waiting longest are the ones holding slots for nothing); only when
  every connection is busy answering is the new one closed;
* the request line and headers must arrive within ``REQUEST_DEADLINE_S`` of the connection
  (the TLS handshake included), and the answer must be taken within
  ``RESPONSE_DEADLINE_S``; a connection past its deadline is shut down by a reaper thread.
  The reaper sleeps until the earliest deadline, and without a timeout while no connection
  is open: an idle agent's HTTP server wakes nothing.

What was refused or cut is counted by reason.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

MAX_CONNECTIONS = 64
REQUEST_DEADLINE_S = 5.0
RESPONSE_DEADLINE_S = 30.0


@dataclass(eq=False)
class Connection:
    """One admitted connection: its socket (the TLS one once wrapped) and its deadline."""

    sock: socket.socket
    deadline: float
    requested: bool = False
    cut: bool = False
    started: float = field(default_factory=time.monotonic)


class ConnectionGate:
    """Admits, times and cuts connections; thread-safe."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS,
                 request_deadline_s: float = REQUEST_DEADLINE_S,
                 response_deadline_s: float = RESPONSE_DEADLINE_S) -> None:
        self.max_connections = max_connections
        self.request_deadline_s = request_deadline_s
        self.response_deadline_s = response_deadline_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._wake_at = float("inf")  # when the reaper next looks; inf: asleep until told
        self._live: set[Connection] = set()
        self.refused_total: Counter[str] = Counter()
        self._stopping = False
        self._reaper = threading.Thread(target=self._reap_loop, name="gpumon-http-reaper",
                                        daemon=True)

    def start(self) -> None:
        """Start cutting connections past their deadline."""
        self._reaper.start()

    def stop(self) -> None:
        """Stop the reaper."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._reaper.is_alive():
            self._reaper.join()

    def admit(self, sock: socket.socket) -> Connection | None:
        """A slot for a new connection, or None (counted) when every slot is answering."""
        now = time.monotonic()
        with self._lock:
            active = [c for c in self._live if not c.cut]
            if len(active) >= self.max_connections:
                waiting = [c for c in active if not c.requested]
                if not waiting:
                    self.refused_total["too_many_connections"] += 1
                    return None
                self._cut(min(waiting, key=lambda c: c.started), "replaced_waiting")
            connection = Connection(sock, now + self.request_deadline_s)
            self._live.add(connection)
            if connection.deadline < self._wake_at:
                self._wake.notify()  # the reaper sleeps past this deadline (or without one)
            return connection

    def requested(self, connection: Connection) -> None:
        """The request has been read: from now on the answer's deadline applies."""
        with self._lock:
            connection.requested = True
            connection.deadline = time.monotonic() + self.response_deadline_s

    def done(self, connection: Connection) -> None:
        """The connection's thread is finishing (call before its socket is closed)."""
        with self._lock:
            self._live.discard(connection)

    def active(self) -> int:
        """Connections being served and not cut."""
        with self._lock:
            return sum(1 for c in self._live if not c.cut)

    def _reap_loop(self) -> None:
        # A deadline only moves later once set (requested() extends it), so sleeping until the
        # earliest one known misses nothing; admit() wakes the reaper for an earlier one.
        with self._lock:
            while not self._stopping:
                now = time.monotonic()
                pending = []
                for connection in self._live:
                    if connection.cut:
                        continue
                    if connection.deadline <= now:
                        self._cut(connection,
                                  "slow_response" if connection.requested else "slow_request")
                    else:
                        pending.append(connection.deadline)
                self._wake_at = min(pending, default=float("inf"))
                if self._wake_at == float("inf"):
                    self._wake.wait()
                else:
                    self._wake.wait(self._wake_at - now)
                self._wake_at = float("inf")

    def _cut(self, connection: Connection, reason: str) -> None:
        """Shut the connection down under its thread (which then finishes); lock held."""
        connection.cut = True
        self.refused_total[reason] += 1
        try:
            connection.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone
