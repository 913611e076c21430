"""Whose each rank and GPU is: the kernel's facts about a process joined with kubelet's names.

Two collectors (``scheduler.Periodic``), the kubelet's on a thread of its own:

- ``kubelet`` asks the PodResources API which container each GPU is allocated to, bounded by a
  timeout; an absent, slow or garbled socket is counted as that collector's error and empties
  the allocations, touching nothing else.
- ``owners`` reads, for every process the agent knows (the kernel-given pid of each rank, every
  pid in NVML's process lists), its cgroup and uid from ``/proc``, and names its container from
  kubelet's container links.

What a process says about itself is never used: the pod and container come from its cgroup,
their names from kubelet, the Slurm job and step from Slurm's cgroup, the user from the uid the
kernel holds. Where a GPU's holder cannot be seen (the agent without the host's pids), the
GPU's owner is the container kubelet allocated it to (``export.owner_metrics``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpumon.collectors.container_logs import CONTAINER_LOGS, ContainerName, container_names
from gpumon.collectors.process_owner import PROC, ProcessFacts, read_process
from gpumon.collectors.samples import Owner
from gpumon.state.owners import OwnerState

FACTS_KEPT_S = 60.0
"""How long a live process's facts (cgroup, uid) are kept before they are read again. A
process is known again by its /proc directory's inode time, set when the kernel made the
inode: another process under the same pid has another. A process moved to another cgroup, or
changing its uid, while it runs is seen within this time."""

KUBELET_TIMEOUT_S = 2.0
"""A List answers in milliseconds; longer means a kubelet in trouble, not one to wait on."""


class OwnerCollector:
    """Works out the owners of processes (/proc, kubelet's container links) and of GPUs
    (PodResources) into an ``OwnerState``."""

    def __init__(self, state: OwnerState, kubelet_socket: str,
                 containers_dir: str = CONTAINER_LOGS, proc: Path = PROC,
                 timeout_s: float = KUBELET_TIMEOUT_S) -> None:
        self._state = state
        self._socket = kubelet_socket
        self._containers_dir = containers_dir
        self._proc = proc
        self._timeout_s = timeout_s
        self._names: Mapping[str, ContainerName] = {}  # the container links the last cycle read
        self._kept: dict[int, tuple[int, float, ProcessFacts]] = {}
        """By pid: its /proc directory's inode time, when its facts were read, and them."""

    def poll_kubelet(self, now: float, monotonic: float) -> None:
        """One PodResources ``List``; on failure the allocations are forgotten and the error
        (a ``PodResourcesError`` with its ``kind``) goes to the scheduler to be counted."""
        # gRPC is loaded here, on a node with a kubelet, never by an agent that has none.
        from gpumon.collectors.podresources import list_gpu_holders

        node = self._state.get().node
        try:
            holders = list_gpu_holders(self._socket, self._timeout_s)
        except Exception:
            self._state.put_allocations({})
            raise
        self._state.put_allocations({
            uuid: Owner(node=node, pod=h.pod, namespace=h.namespace, container=h.container)
            for uuid, h in holders.items()})

    def collect(self, pids: Iterable[int], ended: Iterable[int] = ()) -> None:
        """Attribute every process in ``pids`` that is still there; keep the owner found before
        of each of ``ended`` (processes seen to have exited whose ranks are still shown: their
        pids may already be another process's) and of a process of ``pids`` gone since."""
        before = self._state.get()
        node = before.node
        now = time.monotonic()
        facts = {pid: self._facts(pid, now) for pid in set(pids)}
        for gone in self._kept.keys() - facts.keys():
            del self._kept[gone]
        names = container_names(self._containers_dir) if any(
            f is not None and f.place.container_id for f in facts.values()) else {}
        self._names = names
        by_pid = {pid: before.by_pid[pid] for pid in (*ended, *facts)
                  if pid in before.by_pid and facts.get(pid) is None}
        by_pid.update({pid: attribute(node, f, names) for pid, f in facts.items() if f is not None})
        self._state.put_processes(by_pid)

    def _facts(self, pid: int, now: float) -> ProcessFacts | None:
        """``read_process``, or what it read less than ``FACTS_KEPT_S`` ago of this same
        process (one ``stat`` where the read is two files the kernel writes out)."""
        try:
            made = os.stat(f"{self._proc}/{pid}").st_ctime_ns
        except OSError:
            self._kept.pop(pid, None)
            return None
        kept = self._kept.get(pid)
        if kept is not None and kept[0] == made and now - kept[1] < FACTS_KEPT_S:
            return kept[2]
        found = read_process(pid, self._proc)
        if found is None:
            self._kept.pop(pid, None)
        else:
            self._kept[pid] = (made, now, found)
        return found

    def collect_one(self, pid: int) -> bool:
        """Attribute ``pid`` now, a sender seen for the first time: its cgroup and uid, its
        container named from the links the last cycle read. False when its container is not
        among those yet (a cycle must look at the links again) or the process is gone."""
        found = read_process(pid, self._proc)
        if found is None:
            return False
        self._state.put_process(pid, attribute(self._state.get().node, found, self._names))
        return not found.place.container_id or found.place.container_id in self._names


def attribute(node: str, facts: ProcessFacts, names: Mapping[str, ContainerName]) -> Owner:
    """A process's owner from its facts and the names of the node's containers."""
    place = facts.place
    name = names.get(place.container_id) if place.container_id else None
    return Owner(node=node, pod=name.pod if name else "", namespace=name.namespace if name else "",
                 container=name.container if name else "", slurm_job=place.slurm_job,
                 slurm_step=place.slurm_step, user=facts.user)
