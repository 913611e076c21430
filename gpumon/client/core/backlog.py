"""The sender's backlog: datagrams the agent could not take yet, kept for when it can.

An agent restarting (an upgrade), not started yet, or behind on a burst must not cost the
job its steps: the sender keeps what it could not send, oldest first, and sends it, in order,
before anything newer once the agent answers. Each record was encoded when its step ended, so
it carries the step's own timestamps, and the agent files it where it belongs.

The backlog is bounded three ways, so that an agent that never comes back costs a bounded
amount of the job's memory and nothing else: in records, in bytes, and in age (a step that
has waited ``MAX_AGE_S`` is dropped here, before the agent would refuse it for ending too far
from its clock). What goes over a bound is the oldest, dropped and counted under the reason
it was held for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from time import monotonic

MAX_RECORDS = 16384
"""Records held at most: about a minute of a loop of 4 ms steps."""
MAX_BYTES = 4 * 1024 * 1024
"""Bytes held at most (each datagram counted whole)."""
MAX_AGE_S = 240.0
"""How long a datagram may wait: below the agent's bound on how far a step's end may lie
from its clock (``state/ranks.py``'s ``MAX_CLOCK_SKEW_S``), beyond which it drops the step."""


class Backlog:
    """A bounded queue of (datagram, records in it), oldest first; not thread-safe (the
    sender holds its lock around it). Each datagram may carry a mark, handed back when it
    leaves: the step sequence number below which it and everything before it was sent (the
    sender writes it in its step ring, ``ring.py``)."""

    def __init__(self, max_records: int = MAX_RECORDS, max_bytes: int = MAX_BYTES,
                 max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = monotonic) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        self._items: deque[tuple[bytes, int, float, int | None]] = deque()
        self._fresh = 0
        """How many of the newest items were added by this flush (sent now, not late)."""
        self.records = 0
        self.bytes = 0
        self.late_sent = 0
        """Records sent after waiting at least one flush in the backlog."""

    def __len__(self) -> int:
        return len(self._items)

    def add(self, datagrams: Iterable[tuple[bytes, int]],
            marks: Iterable[int | None] | None = None) -> None:
        """Queue this flush's datagrams behind what waits already (``marks``: one per
        datagram, None where it holds no step)."""
        now = self._clock()
        self._fresh = 0
        datagrams = list(datagrams)
        for (datagram, count), mark in zip(datagrams, marks or [None] * len(datagrams),
                                           strict=True):
            self._items.append((datagram, count, now, mark))
            self.records += count
            self.bytes += len(datagram)
            self._fresh += 1

    def head(self) -> tuple[bytes, int]:
        """The oldest datagram and its record count (the backlog must not be empty)."""
        datagram, count, _, _ = self._items[0]
        return datagram, count

    def pop(self, sent: bool) -> int | None:
        """Take the oldest datagram off, ``sent`` or given up; its mark."""
        datagram, count, _, mark = self._items.popleft()
        self.records -= count
        self.bytes -= len(datagram)
        if len(self._items) < self._fresh:
            self._fresh -= 1
        elif sent:
            self.late_sent += count
        return mark

    def trim(self) -> int:
        """Drop the oldest datagrams beyond the bounds; how many records went."""
        dropped = 0
        oldest = self._clock() - self.max_age_s
        items = self._items
        while items and (self.records > self.max_records or self.bytes > self.max_bytes
                         or items[0][2] < oldest):
            dropped += items[0][1]
            self.pop(sent=False)
        self._fresh = min(self._fresh, len(items))
        return dropped

    def clear(self) -> int:
        """Drop everything; how many records went."""
        dropped = self.records
        self._items.clear()
        self.records = self.bytes = self._fresh = 0
        return dropped
