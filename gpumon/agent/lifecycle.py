"""The gpumon agent: wires collectors, state and the exporter together, with a lifecycle.

Usable as a library::

    agent = Agent(AgentConfig(port=0, simulate=2))
    agent.start()
    ...
    agent.stop()

Data flows one way: the GPU and host collectors (cycles on ``scheduler.Clock`` threads) write
the node state, ingest writes the rank store and feeds the analyzer, housekeeping advances the
analyzer from copies of both, and the views (``views``) read copies of all three. Each
collector starts itself (``collectors/``), through the agent's public surface.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.process_collector import ProcessCollector

from gpumon import __version__
from gpumon.agent.analyzer import SharedAnalyzer
from gpumon.agent.collectors import COLLECTORS
from gpumon.agent.config import AgentConfig
from gpumon.agent.recorder import Recorder
from gpumon.agent.reload import apply_reload
from gpumon.agent.scheduler import Clock, Periodic
from gpumon.agent.sources import given_source_status, open_gpu_source
from gpumon.agent.trace_api import trace_api
from gpumon.agent.traces import TraceDesk, trace_settings
from gpumon.agent.views import AgentCollector, readiness, snapshot_document
from gpumon.collectors.base import GpuSource
from gpumon.collectors.ingest import IngestServer, IngestStatus
from gpumon.collectors.liveness import ExitWatcher, ProcessLiveness, started_monotonic
from gpumon.collectors.rings import RingKeeper
from gpumon.collectors.samples import SenderCredentials
from gpumon.errors import GpumonError
from gpumon.export.render_ahead import RenderAhead
from gpumon.export.server import MetricsServer
from gpumon.export.webconfig import WebConfigError, load_web_config
from gpumon.state.node import NodeState
from gpumon.state.owners import OwnerState
from gpumon.state.ranks import RankStore
from gpumon.state.recording import RecorderStatus
from gpumon.wire import HelloRecord, Record

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 1.0
LIVENESS_INTERVAL_S = 5.0
TIME_LINE_INTERVAL_S = 10.0
"""How often the recording gets each rank's time so far (``time`` lines)."""
"""How often the training processes are looked for in /proc: an exit is seen within 5 s."""


class AgentError(GpumonError, RuntimeError):
    """The agent cannot start; the message says why."""


class Agent:
    """One node's agent. ``start()`` binds the port first, so a busy port fails fast."""

    def __init__(self, config: AgentConfig, gpu_source: GpuSource | None = None) -> None:
        self.config = config
        self.state = NodeState()
        self._gpu_source = gpu_source
        self._clock = Clock("gpumon-clock", self.state)
        self._threads: list[Clock] = [self._clock]
        """The shared clock, and the clocks of cycles that may wait on something else."""
        self._server: MetricsServer | None = None
        self._liveness = ProcessLiveness()
        self._exits = ExitWatcher(max_pids=config.max_ranks)
        self.rank_store = RankStore(ttl_s=config.rank_ttl_seconds, max_ranks=config.max_ranks,
                                    alive=self._liveness.alive, started=started_monotonic)
        self.rings = RingKeeper(config.max_ranks, self.rank_store.count_dropped)
        """The step rings of the live training processes, read when they end."""
        self.analyzer = SharedAnalyzer(resolution_s=config.interval, thresholds=config.thresholds,
                                       ranks=self.rank_store)
        self.owners = OwnerState(config.node_name or socket.gethostname())
        self._sender_watchers: list[Callable[[int], None]] = []
        self._collector = AgentCollector(self.state, self.rank_store, self.recording_status,
                                         self.ingest_status, self.owners,
                                         lambda: self.config.unsaved_alert_seconds)
        # Every collector's families are named at registration, so a clash is refused there.
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self._collector)
        ProcessCollector(namespace="gpumon_agent", registry=self.registry)
        self.render_ahead = RenderAhead(self._collector.render_ranks,
                                        wait_s=self._collector.render_wait_s)
        """Renders the ranks' series once they moved, so the next scrape finds them ready."""
        self.ingest: IngestServer | None = None
        """The ingest server, once the ``ingest`` collector has made it."""
        self.ingest_problem: str | None = None
        self._recorder: Recorder | None = None
        self._liveness_at = 0.0
        self._times_at = 0.0
        self.started_at = time.time()
        self.traces: TraceDesk | None = None
        """Profiler traces asked of the ranks (docs/traces.md); made once ingest runs."""

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        """Bind the HTTP port, open the GPU source and start every collector thread."""
        if self.config.record:
            try:
                self._recorder = Recorder(Path(self.config.record))
            except OSError as exc:
                raise AgentError(f"cannot open recording {self.config.record}: "
                                 f"{exc.strerror or exc}") from exc
        web = None
        if self.config.web_config:
            try:
                web = load_web_config(Path(self.config.web_config))
            except WebConfigError as exc:
                raise AgentError(str(exc)) from exc
        self._server = MetricsServer(self.config.address, self.config.port, self.registry,
                                     self.readiness, self.snapshot, web,
                                     api=trace_api(lambda: self.traces))
        if self._gpu_source is None:
            self._gpu_source, status = open_gpu_source(self.config, self.state.count_error)
        else:
            # A source handed in while simulating is the caller's simulator (`gpumon demo`).
            status = given_source_status(self._gpu_source, simulated=self.config.simulate > 0)
        if not status.up:
            log.warning("no GPU metrics: %s; serving host and step metrics only", status.message)
        source = self._gpu_source
        self.state.set_nvml(status, source.statics() if source else [])
        # A simulated or handed-in GPU source stands in for NVML, whatever --collector says.
        wanted = set(self.config.collectors) | ({"nvml"} if source is not None else set())
        for collector in COLLECTORS:
            if collector.name in wanted:
                collector.start(self)
        self._exits.start()
        self.render_ahead.start()
        self.run_every("housekeeping", HOUSEKEEPING_INTERVAL_S, self._housekeeping)
        for thread in self._threads:
            thread.start()
        self._server.start()
        host = f"[{self.config.address}]" if ":" in self.config.address else self.config.address
        log.info("gpumon %s serving on http://%s:%d/metrics", __version__, host,
                 self._server.port)
        # What exists now (imported modules, the agent's own objects) lives as long as the
        # agent: frozen, its tens of thousands of objects are no longer walked by every full
        # collection, which would land in whichever scrape or ingest is running
        # (benchmarks/bench_internals.py measures what a collection costs before and after).
        gc.collect()
        gc.freeze()

    # -- what collectors use (collectors/base.py's CollectorAgent) ----------------------
    @property
    def gpu_source(self) -> GpuSource | None:
        """NVML, the simulator or the caller's source, once started; None without one."""
        return self._gpu_source

    @property
    def recorder(self) -> Recorder | None:
        """The ``--record`` file's writer, once started; None when nothing is recorded."""
        return self._recorder

    def run_every(self, name: str, interval_s: float, collect: Callable[[float, float], None],
                  finishes_later: bool = False, own_thread: bool = False) -> Periodic:
        """``collect(now, monotonic)`` every ``interval_s``, timed and its errors counted as
        collector ``name``'s, on the agent's shared clock, or, for a cycle that may wait on
        something outside the agent (``own_thread``), a clock of its own; started and stopped
        with the agent. ``finishes_later``: see ``Periodic``."""
        clock = self._clock
        if own_thread:
            clock = Clock(f"gpumon-{name}", self.state)
            self._threads.append(clock)
        return clock.every(name, interval_s, collect, finishes_later)

    def watch_senders(self, seen: Callable[[int], None]) -> None:
        """Have ``seen(pid)`` called with the sender of every datagram that brings accepted
        records, on the ingest thread, before those records are analysed."""
        self._sender_watchers.append(seen)

    def start_traces(self) -> None:
        """Open the desk that asks ranks for profiler traces over the ingest socket
        (docs/traces.md); the ``ingest`` collector calls it once the socket is up."""
        self.traces = TraceDesk(trace_settings(self.config), self.config.socket, self.rank_store)
        self.traces.start()
        self.registry.register(self.traces)

    def reload(self, config: AgentConfig) -> list[str]:
        """Apply what can change while running (SIGHUP); returns one line per setting.

        See ``gpumon.agent.reload``. Raises AgentError (and changes nothing) when the new web
        config is unusable.
        """
        try:
            self.config, notes = apply_reload(self.config, config, server=self._server,
                                              ingest=self.ingest, rank_store=self.rank_store,
                                              analyzer=self.analyzer)
        except WebConfigError as exc:
            raise AgentError(str(exc)) from exc
        if self.traces is not None:
            self.traces.settings = trace_settings(self.config)  # the trace_* keys apply at once
        return notes

    def stop(self) -> None:
        """Stop threads and the server; safe to call twice. Ingest stops first, once it
        has handled every datagram received, and the step counts it reached are logged: with
        the last scrape before, they account for every step this agent counted."""
        if self.ingest is not None:
            self.ingest.stop()
            self.ingest = None
            self.rings.close()
            for rank in sorted(self.rank_store.ranks(), key=lambda r: (r.run, r.rank)):
                log.info("final gpumon_steps_total{run=\"%s\",rank=\"%d\"} %d",
                         rank.run, rank.rank, rank.steps_total)
        if self.traces is not None:
            self.traces.stop()
            self.traces = None
        for thread in self._threads:
            thread.stop()
        if self._server is not None:
            self._server.stop()
            self._server = None
        for thread in self._threads:
            if thread.ident is not None:  # started (a start that failed may not have)
                thread.join(timeout=2.0)
        self.render_ahead.stop()
        if self._recorder is not None:
            self._record_times(time.time(), time.monotonic())
            self._recorder.close()
            self._recorder = None
        self._exits.close()
        alive = [t.name for t in self._threads if t.is_alive()]
        self._threads.clear()
        if self._gpu_source is not None and not alive:
            # A thread stuck inside NVML still holds it: do not shut NVML down under it.
            self._gpu_source.close()
        self._gpu_source = None
        gc.unfreeze()  # a library user's process goes on: let what the agent held be collected

    @property
    def port(self) -> int:
        """The HTTP port actually bound."""
        assert self._server is not None, "agent not started"
        return self._server.port

    # -- collection ----------------------------------------------------------------
    def take_records(self, records: list[Record], sender: SenderCredentials,
                     ended: bool = False) -> None:
        """The records of one datagram (ingest's callback): into the rank store; what it
        accepts is told to the sender watchers (the owners collector), then analysed and
        recorded. ``ended``: those of an ended process, read from its step ring."""
        now = time.time()
        if sender.pid and not ended and self._exits.watch(sender.pid):
            self._take_exits(time.monotonic())  # a successor finds its predecessor's exit known
        accepted = self.rank_store.ingest(records, sender, time.monotonic(), now, ended)
        if not ended:
            self.rings.note(accepted, sender)
        if self._recorder is not None:  # where each rank sits, for a replay's comparisons
            self._recorder.hellos(r for r in records if isinstance(r, HelloRecord))
        if not accepted:
            return
        pids = {(r.run, r.rank): sender.pid or r.pid for r in accepted}
        if sender.pid:
            for seen in self._sender_watchers:
                seen(sender.pid)
        self.analyzer.add(accepted, now, pids)
        if self._recorder is not None:
            self._recorder.steps(accepted)

    def records_settled(self) -> None:
        """Ingest has taken in what was sent (its queue is empty): render the ranks ahead."""
        self.render_ahead.changed()

    def _housekeeping(self, now: float, monotonic: float) -> None:
        # Each rank's analysis goes with it, and its process's ring.
        self.rings.forget(self.rank_store.expire(monotonic))
        self._take_exits(monotonic)
        if monotonic - self._liveness_at >= LIVENESS_INTERVAL_S:
            self._liveness_at = monotonic
            ended = self._liveness.ended(set(self.rank_store.watched_pids()) | self.rings.pids())
            if ended:
                self._ended(ended, monotonic)
        if self.analyzer.has_ranks():
            self.analyzer.advance(now, self.state.snapshot(now), self.state.gpu_history())
            self.render_ahead.changed()  # verdicts, conditions and totals moved with the clock
        if self.traces is not None and self.config.trace_auto:
            self.traces.observe(self.analyzer.analyses())
        if self._recorder is not None:
            if monotonic - self._times_at >= TIME_LINE_INTERVAL_S:
                self._record_times(now, monotonic)
            self._recorder.flush()

    def _record_times(self, now: float, monotonic: float) -> None:
        """Where each rank's time went, into the recording (a report's figures)."""
        assert self._recorder is not None
        self._times_at = monotonic
        self._recorder.times(self.rank_store.time_totals(monotonic),
                             lambda m: now - (monotonic - m), now)

    def _take_exits(self, monotonic: float) -> None:
        """The exits the watcher saw, at the moments it saw them."""
        exits = self._exits.take()
        if exits:
            self._ended(set(exits), monotonic, exits)

    def _ended(self, pids: set[int], monotonic: float,
               exits: dict[int, float] | None = None) -> None:
        """Processes ended: what they had not sent, read from their step rings, is ingested as
        their ranks' steps; then their ranks are marked exited (at ``exits[pid]`` where the
        moment is known)."""
        for records, sender in self.rings.drain(pids):
            self.take_records(records, sender, ended=True)
        self.rank_store.mark_exited(pids, monotonic, exits)

    # -- views -----------------------------------------------------------------------
    def families(self) -> Iterator[Metric]:
        """Every metric family, rendered from one snapshot."""
        return self._collector.collect()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, body): ready unless nothing has been collected yet; says what is degraded."""
        return readiness(self.state.snapshot(time.time()), self.ingest_problem, time.monotonic(),
                         self.recording_status())

    def ingest_status(self) -> IngestStatus | None:
        """The ingest socket's state, or None when the ingest collector is off."""
        if not self.config.enabled("ingest"):
            return None
        ingest = self.ingest
        status = ingest.status() if ingest else IngestStatus(self.config.socket, up=False)
        return dataclasses.replace(status, rings_held=self.rings.held,
                                   ring_records_total=self.rings.recovered_total)

    def recording_status(self) -> RecorderStatus | None:
        """How the ``--record`` file is doing, or None when nothing is recorded."""
        recorder = self._recorder
        return recorder.status() if recorder else None

    def snapshot(self) -> dict[str, Any]:
        """The current state as JSON-ready data (for /api/v1/snapshot and `gpumon top`)."""
        return snapshot_document(self.state.snapshot(time.time()), self.rank_store.ranks(),
                                 self.owners.get())
