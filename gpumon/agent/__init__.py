"""The agent: configuration, node and rank state, collection schedule, lifecycle."""

from gpumon.agent.lifecycle import Agent, AgentError

__all__ = ["Agent", "AgentError"]
