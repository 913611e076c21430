"""Reload as a library call: what changes at once, what waits for a restart, what refuses."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from gpumon.agent.analyzer import SharedAnalyzer
from gpumon.agent.config import AgentConfig
from gpumon.agent.reload import RESTART_ONLY, apply_reload
from gpumon.export.webconfig import WebConfigError
from gpumon.state.ranks import RankStore


def parts(config: AgentConfig) -> tuple[RankStore, SharedAnalyzer]:
    return (RankStore(ttl_s=config.rank_ttl_seconds, max_ranks=config.max_ranks),
            SharedAnalyzer(resolution_s=config.interval, thresholds=config.thresholds))


def test_live_settings_apply_and_bound_ones_wait_for_a_restart() -> None:
    running = AgentConfig(port=9403, interval=1.0, rank_ttl_seconds=300.0, max_ranks=1024)
    store, analyzer = parts(running)
    new = replace(running, port=9500, interval=2.0, rank_ttl_seconds=30.0, max_ranks=8,
                  thresholds=replace(running.thresholds, input_high_fraction=0.3))
    root = logging.getLogger()
    level = root.level
    try:
        in_force, notes = apply_reload(running, replace(new, log_level="debug"), server=None,
                                       ingest=None, rank_store=store, analyzer=analyzer)
    finally:
        root.setLevel(level)
    assert (store.ttl_s, store.max_ranks) == (30.0, 8)
    assert analyzer.thresholds.input_high_fraction == 0.3
    assert (in_force.port, in_force.interval) == (9403, 1.0)  # bound at start: kept
    assert in_force.rank_ttl_seconds == 30.0 and in_force.log_level == "debug"
    assert notes == ["thresholds: reloaded", "log_level: debug",
                     "port: changed, takes effect after a restart",
                     "interval: changed, takes effect after a restart"]
    assert set(RESTART_ONLY) >= {"port", "interval", "socket", "simulate"}


def test_an_unusable_web_config_changes_nothing(tmp_path: Path) -> None:
    running = AgentConfig()
    store, analyzer = parts(running)
    broken = tmp_path / "web.yml"
    broken.write_text("basic_auth_users: [not, a, mapping]\n")
    new = replace(running, web_config=str(broken), max_ranks=3,
                  thresholds=replace(running.thresholds, input_high_fraction=0.4))
    with pytest.raises(WebConfigError):
        apply_reload(running, new, server=None, ingest=None, rank_store=store,
                     analyzer=analyzer)
    assert store.max_ranks == running.max_ranks
    assert analyzer.thresholds == running.thresholds
