"""Whose each process and GPU is, as last worked out by the agent's owner collectors.

Written whole by a collector cycle, read whole by a scrape: immutable ``Ownership`` values
behind a reference swap, so a scrape never sees half a cycle.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from gpumon.collectors.samples import Owner


@dataclass(frozen=True)
class Ownership:
    """The owners of the node's processes (by the pid the kernel gave), and of its GPUs by
    UUID as the kubelet allocated them."""

    node: str = ""
    by_pid: dict[int, Owner] = field(default_factory=dict)
    allocated: dict[str, Owner] = field(default_factory=dict)

    def of_pid(self, pid: int | None) -> Owner:
        """The owner of ``pid``; the node alone where the process was not attributed."""
        found = self.by_pid.get(pid) if pid is not None else None
        return found if found is not None else Owner(node=self.node)


class OwnerState:
    """The latest ``Ownership``: processes and allocations are replaced separately, each by
    its own collector."""

    def __init__(self, node: str) -> None:
        self._lock = threading.Lock()
        self._ownership = Ownership(node=node)

    def put_processes(self, by_pid: dict[int, Owner]) -> None:
        """Replace the owners of processes."""
        with self._lock:
            self._ownership = replace(self._ownership, by_pid=by_pid)

    def put_process(self, pid: int, owner: Owner) -> None:
        """Add (or replace) one process's owner, keeping the others."""
        with self._lock:
            self._ownership = replace(self._ownership, by_pid={**self._ownership.by_pid, pid: owner})

    def put_allocations(self, allocated: dict[str, Owner]) -> None:
        """Replace the GPUs' allocations (empty when the kubelet could not be asked)."""
        with self._lock:
            self._ownership = replace(self._ownership, allocated=allocated)

    def get(self) -> Ownership:
        """What is known now."""
        with self._lock:
            return self._ownership
