"""What a collector's start function may use of the agent: the public surface of
``lifecycle.Agent``, named here because the agent's configuration reads the collector table,
so nothing the table imports may import the agent or its configuration."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpumon.agent.recorder import Recorder
    from gpumon.agent.scheduler import Periodic
    from gpumon.collectors.base import GpuSource
    from gpumon.collectors.ingest import IngestServer
    from gpumon.collectors.rings import RingKeeper
    from gpumon.collectors.samples import SenderCredentials
    from gpumon.state.node import NodeState
    from gpumon.state.owners import OwnerState
    from gpumon.state.ranks import RankStore
    from gpumon.wire import Record


class CollectorSettings(Protocol):
    """The settings of ``config.AgentConfig`` that collectors read."""

    @property
    def interval(self) -> float: ...

    @property
    def socket(self) -> str: ...

    @property
    def socket_group(self) -> str | None: ...

    @property
    def allowed_uids(self) -> tuple[int, ...]: ...

    @property
    def pod_resources_socket(self) -> str: ...


class CollectorAgent(Protocol):
    """The agent as a collector's start function sees it."""

    ingest: IngestServer | None
    """The ingest server, once the ``ingest`` collector has made it."""
    ingest_problem: str | None
    """Why there is no ingest server, when making it failed."""
    rings: RingKeeper
    """The step rings the training processes hand over, kept until they end."""

    @property
    def config(self) -> CollectorSettings: ...

    @property
    def state(self) -> NodeState: ...

    @property
    def rank_store(self) -> RankStore: ...

    @property
    def owners(self) -> OwnerState: ...

    @property
    def gpu_source(self) -> GpuSource | None: ...

    @property
    def recorder(self) -> Recorder | None: ...

    def run_every(self, name: str, interval_s: float, collect: Callable[[float, float], None],
                  finishes_later: bool = False, own_thread: bool = False) -> Periodic: ...

    def take_records(self, records: list[Record], sender: SenderCredentials,
                     ended: bool = False) -> None: ...

    def records_settled(self) -> None: ...

    def watch_senders(self, seen: Callable[[int], None]) -> None: ...

    def start_traces(self) -> None: ...
