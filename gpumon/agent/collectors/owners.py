"""The ``owners`` collector: whose each process and GPU is, worked out by ``agent/owners.py``
every ``OWNERS_INTERVAL_S`` and at once for a process sending its first steps, and the GPUs'
allocations asked of the kubelet on a node that runs one."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumon.agent.collectors.base import CollectorAgent
    from gpumon.agent.owners import OwnerCollector

log = logging.getLogger(__name__)

OWNERS_INTERVAL_S = 5.0
"""How often whose each process and GPU is is worked out again (cgroups, the kubelet)."""


def start(agent: CollectorAgent) -> None:
    """The owners cycle on the agent's clock, told of every sender; the kubelet's on a thread
    of its own."""
    from gpumon.agent.owners import OwnerCollector

    collector = OwnerCollector(agent.owners, agent.config.pod_resources_socket)
    agent.watch_senders(OwnersCycle(agent, collector).sender_seen)
    _start_kubelet(agent, collector)


class OwnersCycle:
    """Every process the agent knows attributed each cycle, and a new sender at once."""

    def __init__(self, agent: CollectorAgent, collector: OwnerCollector) -> None:
        self._agent = agent
        self._collector = collector
        self._pids: set[int] = set()
        """The senders' pids the cycle has been told of: a new one is attributed at once, so a
        rank is attributed at its first step, not up to ``OWNERS_INTERVAL_S`` later (or never,
        for a process shorter than that)."""
        self._cycle = agent.run_every("owners", OWNERS_INTERVAL_S, self.collect)

    def collect(self, now: float, monotonic: float) -> None:
        """Attribute every process in NVML's lists and every rank's, keeping the owners of the
        ranks' exited processes."""
        agent = self._agent
        snap = agent.state.snapshot(now)
        listed = {pid for sample in snap.latest.values()
                  for pid in sample.process_memory_bytes or ()}
        watched = set(agent.rank_store.watched_pids())
        self._pids = watched
        self._collector.collect(listed | watched, agent.rank_store.exited_pids())

    def sender_seen(self, pid: int) -> None:
        """Attribute a new sender's process on the ingest thread, before its first step is
        analysed (two small /proc reads, once per process): a job of a few seconds, or one that
        fails at once, is still someone's. A container not named yet wakes the cycle that
        reads the links."""
        if pid in self._pids:
            return
        self._pids.add(pid)
        try:
            named = self._collector.collect_one(pid)
        except Exception:  # the cycle tries again, and counts its errors
            named = False
        if not named:
            self._cycle.wake()


def _start_kubelet(agent: CollectorAgent, collector: OwnerCollector) -> None:
    """Ask the kubelet's PodResources API on a node that runs one and lets the agent in."""
    path = Path(agent.config.pod_resources_socket)
    if not path.parent.is_dir():
        return  # no kubelet here (a Slurm node, a workstation)
    if path.exists() and not os.access(path, os.W_OK):
        log.warning("the kubelet's PodResources socket %s admits only its owner, not uid %d:"
                    " GPUs are attributed from their processes' cgroups alone", path,
                    os.getuid())
        return
    agent.run_every("kubelet", OWNERS_INTERVAL_S, collector.poll_kubelet, own_thread=True)
