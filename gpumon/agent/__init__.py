"""The agent: configuration, node and rank state, collection schedule, lifecycle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumon.agent.lifecycle import Agent, AgentError

__all__ = ["Agent", "AgentError"]


def __getattr__(name: str) -> Any:
    # The exporter reads the state types (agent.node, agent.ranks) and the lifecycle imports
    # the exporter: loading the lifecycle only when it is asked for keeps that from a cycle.
    if name in __all__:
        from gpumon.agent import lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
