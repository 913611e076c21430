"""The agent's collectors, registered in one table: a name, what it collects, whether it runs
when ``--collector`` names none, and the function that starts it in an agent.

The flag's choices and help (``config.py``, ``cli.py``) and the agent's start loop
(``lifecycle.py``) are made from this table, the way node_exporter's collectors register
themselves. Each collector is its own module here, holding its start function: it makes what
it reads from and gives the agent its threads, taking what it needs of the agent through
``base.CollectorAgent``. A new collector is a row here and its module.

A start function imports what it starts when it runs, so importing the table loads no
collector: the command line reads the table for every command.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumon.agent.collectors import host, ingest, nvml, owners

if TYPE_CHECKING:
    from gpumon.agent.collectors.base import CollectorAgent


@dataclass(frozen=True, slots=True)
class CollectorEntry:
    """One collector the agent can run."""

    name: str
    help: str
    default: bool
    start: Callable[[CollectorAgent], None]


COLLECTORS: tuple[CollectorEntry, ...] = (
    CollectorEntry("nvml", "GPUs", True, nvml.start),
    CollectorEntry("host", "CPU and memory", True, host.start),
    CollectorEntry("ingest", "training steps", True, ingest.start),
    CollectorEntry("owners", "whose each rank and GPU is: cgroups, uids, the kubelet", True,
                   owners.start),
)

NAMES = tuple(c.name for c in COLLECTORS)
DEFAULTS = tuple(c.name for c in COLLECTORS if c.default)


def flag_help() -> str:
    """The ``--collector`` flag's help, one clause per collector."""
    listed = ", ".join(f"{c.name} ({c.help}{'' if c.default else ', off by default'})"
                       for c in COLLECTORS)
    return f"Collect only from these (repeatable): {listed} [env GPUMON_COLLECTORS]."
