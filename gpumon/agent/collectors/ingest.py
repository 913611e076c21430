"""The ``ingest`` collector: the Unix socket the training processes send their steps to, and
the profiler-trace desk that asks them over it (docs/traces.md)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumon.agent.collectors.base import CollectorAgent

log = logging.getLogger(__name__)


def start(agent: CollectorAgent) -> None:
    """Receive steps into the agent; a socket that cannot be made is the agent's
    ``ingest_problem``, not a failed start."""
    from gpumon.collectors.ingest import IngestError, IngestServer

    config = agent.config
    try:
        ingest = IngestServer(Path(config.socket), agent.take_records,
                              agent.rank_store.count_dropped, config.allowed_uids,
                              config.socket_group, on_ring=agent.rings.take,
                              on_settled=agent.records_settled)
    except IngestError as exc:
        # GPU and host metrics are still worth serving: say so loudly, keep going.
        agent.ingest_problem = str(exc)
        log.error("no training-step ingest: %s", exc)
        return
    agent.ingest = ingest
    ingest.start()
    log.info("receiving training steps on %s%s", config.socket,
             " (held by the service manager)" if ingest.inherited else "")
    agent.start_traces()
