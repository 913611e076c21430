"""The ``host`` collector: the node's CPU and memory, and the CPU and memory of the processes
that send training steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumon.agent.collectors.base import CollectorAgent

HOST_INTERVAL_S = 5.0


def start(agent: CollectorAgent) -> None:
    """Sample the host on the agent's clock, every interval but at most every
    ``HOST_INTERVAL_S``."""
    from gpumon.collectors.host import HostSource

    host = HostSource()

    def collect(now: float, monotonic: float) -> None:
        agent.state.put_host(host.sample(now), host.processes(agent.rank_store.pids()))

    agent.run_every("host", max(agent.config.interval, HOST_INTERVAL_S), collect)
