"""Applying a new configuration to a running agent (SIGHUP).

Users, TLS certificates, the uid allow-list, rank TTL and cap, thresholds and the log level
change at once; the settings below are bound at start (a socket, a port, threads, a file) and
are reported as needing a restart. A web config that cannot be loaded changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from gpumon.agent.analyzer import SharedAnalyzer
from gpumon.agent.config import AgentConfig
from gpumon.collectors.ingest import IngestServer
from gpumon.export.server import MetricsServer
from gpumon.export.webconfig import WebConfig, load_web_config
from gpumon.state.ranks import RankStore

RESTART_ONLY = ("address", "port", "socket", "socket_group", "interval", "collectors", "simulate",
                "record", "node_name", "pod_resources_socket")


def apply_reload(running: AgentConfig, new: AgentConfig, *, server: MetricsServer | None,
                 ingest: IngestServer | None, rank_store: RankStore,
                 analyzer: SharedAnalyzer) -> tuple[AgentConfig, list[str]]:
    """Apply what can change now; returns the configuration now in force and one line per
    setting. Raises ``WebConfigError`` (having changed nothing) when the new web config is
    unusable."""
    web = load_web_config(Path(new.web_config)) if new.web_config else None
    notes = []
    if server is not None and (new.web_config or running.web_config):
        server.set_web(web or WebConfig())
        notes.append(f"web_config: reloaded {new.web_config or '(none)'}")
    if ingest is not None and new.allowed_uids != running.allowed_uids:
        ingest.set_allowed_uids(new.allowed_uids)
        notes.append(f"allowed_uids: {list(new.allowed_uids) or 'anyone'}")
    rank_store.ttl_s, rank_store.max_ranks = new.rank_ttl_seconds, new.max_ranks
    if new.thresholds != running.thresholds:
        analyzer.set_thresholds(new.thresholds)
        notes.append("thresholds: reloaded")
    if new.log_level != running.log_level:
        logging.getLogger().setLevel(new.log_level.upper())
        notes.append(f"log_level: {new.log_level}")
    for name in RESTART_ONLY:
        if getattr(new, name) != getattr(running, name):
            notes.append(f"{name}: changed, takes effect after a restart")
    in_force = dataclasses.replace(new, **{n: getattr(running, n) for n in RESTART_ONLY})
    return in_force, notes
