"""How the cap on live (run, rank) pairs is shared between the ingest socket's senders.

Two levels, both from the kernel's credentials of each datagram: users (uid), then the
processes (pid) of one user. In containers every job runs as root, so sharing by user alone
let one runaway process (a run name per step, say) hold the whole cap and lock the next job
out, though it ran as the same user.

When the cap is full and a sender brings a new pair:

1. A user holding less than its share of the cap (the cap over the users holding pairs,
   itself counted) takes the place of the least recently reporting pair of the biggest
   holder among the user holding the most: evicted as ``over_share``.
2. Else, a process holding less than its share of its user's pairs (those pairs over the
   user's processes holding any, itself counted) takes the place of the least recently
   reporting pair of its user's biggest process: evicted as ``process_over_share``.
3. Else the user's own least recently reporting pair, if silent for ``idle_evict_s``, gives
   its place (``idle``): a sweep of short runs replaces its own quiet pairs.
4. Else the new pair is refused, and the reason says which rule refused it:
   ``too_many_ranks_process`` when other processes of the same user hold pairs (the process
   is at its share of them), ``too_many_ranks`` otherwise (the user is at its share of the cap).

So a process may hold the whole cap while nobody else needs room, and never more than its
share once another process or user does: a new job's first pair always gets in at once.
A pair counts for the process that last sent it (a restarted rank moves to its new process).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

Uid = int | None
"""None: a sender the kernel gave no credentials for (library use)."""
Pid = int | None
Sender = tuple[Uid, Pid]
Key = TypeVar("Key")

OVER_SHARE = "over_share"
PROCESS_OVER_SHARE = "process_over_share"
IDLE = "idle"
EVICTION_REASONS = (OVER_SHARE, PROCESS_OVER_SHARE, IDLE)
USER_AT_SHARE = "too_many_ranks"
PROCESS_AT_SHARE = "too_many_ranks_process"
REFUSAL_REASONS = (USER_AT_SHARE, PROCESS_AT_SHARE)


class SenderShares(Generic[Key]):
    """Which sender holds each pair, least recently reporting first, and who gives way."""

    def __init__(self, max_pairs: int, idle_evict_s: float) -> None:
        self.max_pairs = max_pairs
        self.idle_evict_s = idle_evict_s
        self._sender_of: dict[Key, Sender] = {}
        self._by_sender: dict[Sender, OrderedDict[Key, None]] = {}
        self._by_uid: dict[Uid, OrderedDict[Key, None]] = {}
        self._senders_of_uid: dict[Uid, set[Sender]] = {}

    def add(self, key: Key, sender: Sender) -> None:
        """``key`` is new, held by ``sender``."""
        self._sender_of[key] = sender
        self._by_sender.setdefault(sender, OrderedDict())[key] = None
        self._by_uid.setdefault(sender[0], OrderedDict())[key] = None
        self._senders_of_uid.setdefault(sender[0], set()).add(sender)

    def touch(self, key: Key, sender: Sender) -> None:
        """``sender`` (of the pair's uid) reported ``key`` again: most recent from now on."""
        held_by = self._sender_of[key]
        if held_by != sender:  # another process of the same user: the pair moves to it
            self.remove(key)
            self.add(key, sender)
            return
        self._by_sender[sender].move_to_end(key)
        self._by_uid[sender[0]].move_to_end(key)

    def remove(self, key: Key) -> None:
        """``key`` is gone (expired or evicted)."""
        sender = self._sender_of.pop(key)
        uid = sender[0]
        own = self._by_sender[sender]
        del own[key]
        if not own:
            del self._by_sender[sender]
            self._senders_of_uid[uid].discard(sender)
        of_uid = self._by_uid[uid]
        del of_uid[key]
        if not of_uid:
            del self._by_uid[uid]
            del self._senders_of_uid[uid]

    def held(self, sender: Sender) -> int:
        """How many pairs ``sender`` holds."""
        return len(self._by_sender.get(sender, ()))

    def make_room(self, sender: Sender, monotonic: float,
                  last_seen: Callable[[Key], float]) -> tuple[Key | None, str]:
        """For a new pair of ``sender`` with the cap full: (the pair to evict, why), or
        (None, the refusal reason)."""
        uid = sender[0]
        users = self._by_uid
        user_share = self.max_pairs // (len(users) + (uid not in users))
        user_held = len(users.get(uid, ()))
        if user_held < user_share:
            top = max(users, key=lambda u: (len(users[u]), -last_seen(next(iter(users[u])))))
            return self._oldest_of_biggest(self._senders_of_uid[top], last_seen), OVER_SHARE
        processes = self._senders_of_uid.get(uid, set())
        others = processes - {sender}
        process_share = user_held // (len(others) + 1)
        if others and self.held(sender) < process_share:
            return self._oldest_of_biggest(others, last_seen), PROCESS_OVER_SHARE
        own = users.get(uid)
        if own:
            oldest = next(iter(own))
            if monotonic - last_seen(oldest) >= self.idle_evict_s:
                return oldest, IDLE
        return None, PROCESS_AT_SHARE if others else USER_AT_SHARE

    def _oldest_of_biggest(self, senders: set[Sender], last_seen: Callable[[Key], float]) -> Key:
        """The least recently reporting pair of the sender holding the most (of ``senders``;
        between equals, the one whose oldest pair is oldest)."""
        by_sender = self._by_sender
        biggest = max(senders, key=lambda s: (len(by_sender[s]),
                                              -last_seen(next(iter(by_sender[s])))))
        return next(iter(by_sender[biggest]))

    def senders(self) -> Counter[Sender]:
        """Pairs held by each sender."""
        return Counter({s: len(keys) for s, keys in self._by_sender.items()})
