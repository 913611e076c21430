"""The agent's collectors, registered in one table: a name, what it collects, whether it runs
when ``--collector`` names none, and the function that starts it in an agent.

The flag's choices and help (``config.py``, ``cli.py``) and the agent's start loop
(``lifecycle.py``) are made from this table, the way node_exporter's collectors register
themselves: a new collector is a row here and the agent method its start function calls.
Importing this module loads no collector, so the command line reads the table cheaply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Agent(Protocol):
    """What a start function needs of the agent (``lifecycle.Agent``), named here so that this
    table imports nothing of the agent's."""

    def _start_gpus(self) -> None: ...
    def _start_host(self) -> None: ...
    def _start_ingest(self) -> None: ...
    def _start_owners(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CollectorEntry:
    """One collector the agent can run."""

    name: str
    help: str
    default: bool
    start: Callable[[Agent], None]


def _start_nvml(agent: Agent) -> None:
    agent._start_gpus()


def _start_host(agent: Agent) -> None:
    agent._start_host()


def _start_ingest(agent: Agent) -> None:
    agent._start_ingest()


def _start_owners(agent: Agent) -> None:
    agent._start_owners()


COLLECTORS: tuple[CollectorEntry, ...] = (
    CollectorEntry("nvml", "GPUs", True, _start_nvml),
    CollectorEntry("host", "CPU and memory", True, _start_host),
    CollectorEntry("ingest", "training steps", True, _start_ingest),
    CollectorEntry("owners", "whose each rank and GPU is: cgroups, uids, the kubelet", True,
                   _start_owners),
)

NAMES = tuple(c.name for c in COLLECTORS)
DEFAULTS = tuple(c.name for c in COLLECTORS if c.default)


def flag_help() -> str:
    """The ``--collector`` flag's help, one clause per collector."""
    listed = ", ".join(f"{c.name} ({c.help}{'' if c.default else ', off by default'})"
                       for c in COLLECTORS)
    return f"Collect only from these (repeatable): {listed} [env GPUMON_COLLECTORS]."
