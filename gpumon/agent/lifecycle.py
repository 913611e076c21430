"""The gpumon agent: wires collectors, state and the exporter together, with a lifecycle.

Usable as a library::

    agent = Agent(AgentConfig(port=0, simulate=2))
    agent.start()
    ...
    agent.stop()
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.process_collector import ProcessCollector

from gpumon import __version__
from gpumon.agent.config import AgentConfig
from gpumon.agent.node import NodeState, NvmlStatus
from gpumon.agent.ranks import RankStore, RankTotals
from gpumon.agent.recorder import Recorder
from gpumon.analysis.stream import RankAnalysis, StepAnalyzer
from gpumon.collectors.host import HostSource
from gpumon.collectors.ingest import IngestError, IngestServer
from gpumon.collectors.samples import GpuSample, GpuStatic, SenderCredentials
from gpumon.export.gpu_metrics import node_families
from gpumon.export.health_metrics import recording_families
from gpumon.export.memory_metrics import MemoryFamilies
from gpumon.export.server import MetricsServer
from gpumon.export.step_metrics import StepFamilies
from gpumon.export.webconfig import WebConfig, WebConfigError, load_web_config
from gpumon.wire import Record

log = logging.getLogger(__name__)

HOST_INTERVAL_S = 5.0
DISCOVER_EVERY_CYCLES = 30  # look for GPUs that appeared after start (30 s at 1 s polls)
HOUSEKEEPING_INTERVAL_S = 1.0
STUCK_AFTER_INTERVALS = 3


class GpuSource(Protocol):
    """What the agent needs from NVML or the simulator."""

    name: str
    driver_version: str
    nvml_version: str

    def statics(self) -> list[GpuStatic]: ...

    def sample(self, now: float, monotonic: float) -> list[GpuSample]: ...

    def xid_watcher(self, on_xid: Callable[[int, int], None]) -> Any: ...

    def discover(self) -> list[GpuStatic]: ...

    def close(self) -> None: ...


class _Periodic(threading.Thread):
    """Runs ``fn`` every ``interval_s`` on its own thread, timing it and counting errors."""

    def __init__(self, name: str, interval_s: float, fn: Callable[[float, float], None],
                 state: NodeState) -> None:
        super().__init__(name=f"gpumon-{name}", daemon=True)
        self.collector = name
        self._interval_s = interval_s
        self._fn = fn
        self._state = state
        self._stop_event = threading.Event()
        self._logged: set[str] = set()

    def run(self) -> None:
        stats = self._state.collector(self.collector, self._interval_s)
        next_tick = time.monotonic()
        while not self._stop_event.is_set():
            started = time.monotonic()
            stats.running_since_monotonic = started
            stats.last_attempt_t = time.time()
            try:
                self._fn(stats.last_attempt_t, started)
            except Exception as exc:  # a collector failure must never stop the agent
                kind = type(exc).__name__
                self._state.count_error(self.collector, kind.lower())
                if kind not in self._logged:
                    self._logged.add(kind)
                    log.exception("collector %s failed (further %s errors are only counted)",
                                  self.collector, kind)
            else:
                stats.last_success_t = stats.last_attempt_t
            finally:
                stats.running_since_monotonic = None
                stats.last_duration_s = time.monotonic() - started
            next_tick += self._interval_s
            delay = next_tick - time.monotonic()
            if delay < 0:  # overran: skip missed ticks instead of bursting
                next_tick = time.monotonic()
                delay = 0.0
            self._stop_event.wait(delay)

    def stop(self) -> None:
        """Finish after the current cycle."""
        self._stop_event.set()


class _NodeCollector:
    """prometheus-client Collector: families are rendered from a snapshot at scrape time."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        yield from self._agent.families()

    def describe(self) -> list[Metric]:
        return []  # nothing to describe up front: registering must not do I/O


def open_gpu_source(config: AgentConfig,
                    on_error: Callable[[str, str], None]) -> tuple[GpuSource | None, NvmlStatus]:
    """NVML, or the simulator when asked; ``None`` with a reason when neither is available."""
    if config.simulate:
        from gpumon.sim.gpus import SimulatedSource

        source = SimulatedSource(config.simulate)
        return source, NvmlStatus(up=True, driver_version=source.driver_version,
                                  nvml_version=source.nvml_version, simulated=True,
                                  message=f"simulating {config.simulate} GPUs")
    if not config.enabled("nvml"):
        return None, NvmlStatus(up=False, message="NVML collector disabled")
    from gpumon.collectors.nvml import NvmlSource, NvmlUnavailable

    try:
        nvml = NvmlSource(on_error)
    except NvmlUnavailable as exc:
        return None, NvmlStatus(up=False, message=str(exc))
    return nvml, NvmlStatus(up=True, driver_version=nvml.driver_version,
                            nvml_version=nvml.nvml_version)


class AgentError(RuntimeError):
    """The agent cannot start; the message says why."""


class Agent:
    """One node's agent. ``start()`` binds the port first, so a busy port fails fast."""

    def __init__(self, config: AgentConfig, gpu_source: GpuSource | None = None) -> None:
        self.config = config
        self.state = NodeState()
        self._gpu_source = gpu_source
        self._threads: list[_Periodic] = []
        self._xid: Any = None
        self._server: MetricsServer | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_NodeCollector(self))
        ProcessCollector(namespace="gpumon_agent", registry=self.registry)
        self._host = HostSource() if config.enabled("host") else None
        self.rank_store = RankStore(ttl_s=config.rank_ttl_seconds, max_ranks=config.max_ranks)
        self.analyzer = StepAnalyzer(resolution_s=config.interval, thresholds=config.thresholds)
        self._analyzer_lock = threading.Lock()  # fed by ingest, run by housekeeping
        self._step_families = StepFamilies()  # keeps each run's series rendered
        self._memory_families = MemoryFamilies()
        self._ingest: IngestServer | None = None
        self.ingest_problem: str | None = None
        self._recorder: Recorder | None = None
        self._discovered_at = time.monotonic()
        self.started_at = time.time()

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
                                     self.readiness, self.snapshot, web)
        if self._gpu_source is None:
            self._gpu_source, status = open_gpu_source(self.config, self.state.count_error)
        else:
            # A source handed in while simulating is the caller's simulator (`gpumon demo`).
            status = NvmlStatus(up=True, driver_version=self._gpu_source.driver_version,
                                nvml_version=self._gpu_source.nvml_version,
                                simulated=self.config.simulate > 0)
        if not status.up:
            log.warning("no GPU metrics: %s; serving host and step metrics only", status.message)
        source = self._gpu_source
        self.state.set_nvml(status, source.statics() if source else [])
        if source is not None:
            self._threads.append(_Periodic(source.name, self.config.interval,
                                           self._collect_gpus, self.state))
            self._xid = source.xid_watcher(self.state.add_xid)
        if self._host is not None:
            self._threads.append(_Periodic("host", max(self.config.interval, HOST_INTERVAL_S),
                                           self._collect_host, self.state))
        if self.config.enabled("ingest"):
            self._start_ingest()
        self._threads.append(_Periodic("housekeeping", HOUSEKEEPING_INTERVAL_S,
                                       self._housekeeping, self.state))
        for thread in self._threads:
            thread.start()
        if self._xid is not None:
            self._xid.start()
        self._server.start()
        log.info("gpumon %s serving on http://%s:%d/metrics", __version__,
                 self.config.address, self._server.port)
        # What exists now (imported modules, the agent's own objects) lives as long as the
        # agent: frozen, the ~25,000 objects are no longer walked by every full collection
        # (3-20 ms each, landing in whichever scrape or ingest is running).
        gc.collect()
        gc.freeze()

    def _start_ingest(self) -> None:
        try:
            self._ingest = IngestServer(Path(self.config.socket), self._on_records,
                                        self.rank_store.count_dropped, self.config.allowed_uids)
        except IngestError as exc:
            # GPU and host metrics are still worth serving: say so loudly, keep going.
            self.ingest_problem = str(exc)
            log.error("no training-step ingest: %s", exc)
            return
        self._ingest.start()
        log.info("receiving training steps on %s", self.config.socket)

    def reload(self, config: AgentConfig) -> list[str]:
        """Apply what can change while running (SIGHUP); returns one line per setting.

        Users, TLS certificates, the uid allow-list, rank TTL and cap, and the log level change
        at once; address, port, socket, interval, collectors, simulation and recording need a
        restart and are reported as such. Raises AgentError (and changes nothing) when the
        new web config is unusable.
        """
        web = None
        if config.web_config:
            try:
                web = load_web_config(Path(config.web_config))
            except WebConfigError as exc:
                raise AgentError(str(exc)) from exc
        notes = []
        if self._server is not None and (config.web_config or self.config.web_config):
            self._server.set_web(web or WebConfig())
            notes.append(f"web_config: reloaded {config.web_config or '(none)'}")
        if self._ingest is not None and config.allowed_uids != self.config.allowed_uids:
            self._ingest.set_allowed_uids(config.allowed_uids)
            notes.append(f"allowed_uids: {list(config.allowed_uids) or 'anyone'}")
        self.rank_store.ttl_s, self.rank_store.max_ranks = config.rank_ttl_seconds, config.max_ranks
        if config.thresholds != self.config.thresholds:
            with self._analyzer_lock:
                self.analyzer.thresholds = config.thresholds
            notes.append("thresholds: reloaded")
        if config.log_level != self.config.log_level:
            logging.getLogger().setLevel(config.log_level.upper())
            notes.append(f"log_level: {config.log_level}")
        for name in ("address", "port", "socket", "interval", "collectors", "simulate", "record"):
            if getattr(config, name) != getattr(self.config, name):
                notes.append(f"{name}: changed, takes effect after a restart")
        self.config = dataclasses.replace(
            config, **{n: getattr(self.config, n) for n in (
                "address", "port", "socket", "interval", "collectors", "simulate", "record")})
        return notes

    def stop(self) -> None:
        """Stop threads and the server; safe to call twice."""
        if self._ingest is not None:
            self._ingest.stop()
            self._ingest = None
        for thread in self._threads:
            thread.stop()
        if self._xid is not None:
            self._xid.stop()
        if self._server is not None:
            self._server.stop()
            self._server = None
        for thread in self._threads:
            thread.join(timeout=2.0)
        if self._xid is not None:
            self._xid.join(timeout=2.0)
            self._xid.close()
            self._xid = None
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
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
    def _collect_gpus(self, now: float, monotonic: float) -> None:
        source = self._gpu_source
        assert source is not None
        if monotonic - self._discovered_at >= DISCOVER_EVERY_CYCLES * self.config.interval:
            self._discovered_at = monotonic
            new = source.discover()
            if new:
                log.info("new GPU(s) found: %s", ", ".join(f"{g.index} ({g.uuid})" for g in new))
                self.state.set_nvml(self.state.nvml, source.statics())
        samples = source.sample(now, monotonic)
        self.state.put_gpu_samples(samples)
        if self._recorder is not None:
            self._recorder.gpus(samples, self.state.gpu_statics())

    def _collect_host(self, now: float, monotonic: float) -> None:
        assert self._host is not None
        self.state.put_host(self._host.sample(now), self._host.processes(self.rank_store.pids()))

    def _on_records(self, records: list[Record], sender: SenderCredentials) -> None:
        now = time.time()
        accepted = self.rank_store.ingest(records, sender, time.monotonic(), now)
        if not accepted:
            return
        pids = {(r.run, r.rank): sender.pid or r.pid for r in accepted}
        with self._analyzer_lock:
            self.analyzer.add(accepted, now, pids)
        if self._recorder is not None:
            self._recorder.steps(accepted)

    def _housekeeping(self, now: float, monotonic: float) -> None:
        expired = self.rank_store.expire(monotonic)
        snap = self.state.snapshot(now)
        with self._analyzer_lock:
            self.analyzer.forget(expired)
            slices = self.analyzer.process_in_slices(now, self._gpu_window, snap.gpus,
                                                     snap.latest)
        # A whole pass holds the GIL for 5-15 ms at 64 ranks. In slices of ~1 ms, with the
        # lock released and the GIL offered (sleep) between them, a scrape or an ingest
        # waits for one slice instead; the results are the same (see process_in_slices).
        while True:
            with self._analyzer_lock:
                if next(slices, None) is None:
                    break
            time.sleep(0)
        if self._recorder is not None:
            self._recorder.flush()

    def _gpu_window(self, index: int, t0: float, t1: float) -> list[GpuSample]:
        return [s for s in self.state.gpu_history(index, t0) if s.t <= t1]

    # -- views -----------------------------------------------------------------------
    def families(self) -> Iterator[Metric]:
        """Every metric family, rendered from one snapshot."""
        snap = self.state.snapshot(time.time())
        yield from node_families(snap)
        records, dropped = self.rank_store.counters()
        with self._analyzer_lock:
            analyses = self.analyzer.analyses()
        uuids = {g.index: g.uuid for g in snap.gpus}
        resolved = {(a.run, a.rank): uuids[a.gpu] for a in analyses if a.gpu in uuids}
        ranks = self.rank_store.ranks()
        yield from self._step_families.steps(ranks, records, dropped,
                                             snap.processes, resolved)
        yield from self._step_families.analyses(analyses)
        yield from self._memory_families.families(ranks, analyses)
        recorder = self._recorder
        yield from recording_families(recorder.status() if recorder else None)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, body): ready unless nothing has been collected yet; says what is degraded."""
        snap = self.state.snapshot(time.time())
        problems: list[str] = []
        if not snap.nvml.up:
            problems.append(f"nvml: {snap.nvml.message}")
        now_monotonic = time.monotonic()
        for name, stats in sorted(snap.collectors.items()):
            started = stats.running_since_monotonic
            if stats.interval_s and started is not None and (
                    now_monotonic - started > STUCK_AFTER_INTERVALS * stats.interval_s + 2.0):
                problems.append(f"{name}: cycle stuck for {now_monotonic - started:.0f}s")
        if self.ingest_problem:
            problems.append(f"ingest: {self.ingest_problem}")
        recorder = self._recorder
        recording = recorder.status() if recorder else None
        if recording is not None and recording.error:
            problems.append(f"recording: cannot write {recording.path}: {recording.error} "
                            f"({recording.backlog_bytes} bytes waiting, "
                            f"{recording.lines_dropped_total} lines dropped)")
        lost = [str(i) for i, s in snap.latest.items() if not s.up]
        if lost:
            problems.append(f"gpu lost: {', '.join(sorted(lost))}")
        collected = any(s.last_success_t is not None for s in snap.collectors.values())
        status = "starting" if not collected else ("degraded" if problems else "ok")
        return collected, {"status": status, "problems": problems}

    def snapshot(self) -> dict[str, Any]:
        """The current state as JSON-ready data (for /api/v1/snapshot and `gpumon top`)."""
        snap = self.state.snapshot(time.time())
        with self._analyzer_lock:
            analyses = {(a.run, a.rank): a for a in self.analyzer.analyses()}
        gpus = []
        for gpu in snap.gpus:
            sample = snap.latest.get(gpu.index)
            entry: dict[str, Any] = {
                "index": gpu.index, "uuid": gpu.uuid, "model": gpu.name,
                "pci_bus_id": gpu.pci_bus_id, "up": sample.up if sample else True,
            }
            if sample is not None:
                entry.update({k: v for k, v in _sample_dict(sample).items() if v is not None})
            gpus.append(entry)
        host = snap.host
        return {
            "version": __version__,
            "t": snap.t,
            "nvml": {"up": snap.nvml.up, "driver_version": snap.nvml.driver_version,
                     "nvml_version": snap.nvml.nvml_version, "simulated": snap.nvml.simulated,
                     "message": snap.nvml.message},
            "gpus": gpus,
            "host": None if host is None else {
                "cpu_utilization_ratio": host.cpu_utilization_ratio,
                "memory_used_bytes": host.memory_used_bytes,
                "memory_total_bytes": host.memory_total_bytes},
            "xid_errors": [{"gpu": g, "xid": x, "count": c}
                           for (g, x), c in sorted(snap.xid_counts.items())],
            "ranks": [_rank_dict(r, analyses.get((r.run, r.rank)))
                      for r in sorted(self.rank_store.ranks(), key=lambda r: (r.run, r.rank))],
        }


def _sample_dict(sample: GpuSample) -> dict[str, Any]:
    data = asdict(sample)
    data.pop("index", None)
    if data.get("process_memory_bytes"):
        data["process_memory_bytes"] = {str(k): v for k, v in data["process_memory_bytes"].items()}
    return data


def _rank_dict(state: RankTotals, analysis: RankAnalysis | None) -> dict[str, Any]:
    return {
        "run": state.run, "rank": state.rank, "world": state.world,
        "local_rank": state.local_rank, "pid": state.pid, "gpu": state.gpu_hint,
        "steps_total": state.steps_total, "last_step": state.last_step,
        "last_step_end_t": state.last_step_end_t,
        "phase_seconds_total": dict(state.phase_seconds_total),
        "memory_allocated_bytes": state.memory_allocated_bytes,
        "memory_reserved_bytes": state.memory_reserved_bytes,
        "memory_peak_bytes": state.memory_peak_bytes,
        "alloc_retries_total": state.alloc_retries_total, "ooms_total": state.ooms_total,
        "last_step_duration_seconds": state.last_duration_s,
        "memory_breakdown": None if state.memory_breakdown is None
        else asdict(state.memory_breakdown),
        "analysis": None if analysis is None else _analysis_dict(analysis),
    }


def _analysis_dict(analysis: RankAnalysis) -> dict[str, Any]:
    verdict, oom = analysis.verdict, analysis.oom
    return {
        "gpu": analysis.gpu, "verdict_step": analysis.verdict_step,
        "bottleneck": verdict.primary.value if verdict else None,
        "confidence": verdict.confidence if verdict else None,
        "flags": sorted(f.value for f in verdict.flags) if verdict else [],
        "hint": verdict.hint if verdict else None,
        "mfu": verdict.mfu if verdict else None,
        "bottleneck_steps": dict(analysis.bottleneck_steps),
        "straggler_score": analysis.straggler_score,
        "memory": None if analysis.memory is None else {
            "component": analysis.memory.component, "cause": analysis.memory.cause,
            "bytes": analysis.memory.bytes, "remedy": analysis.memory.remedy},
        "oom": None if oom is None else {
            "risk_ratio": oom.risk_ratio, "predicted_seconds": oom.predicted_seconds,
            "headroom_bytes": oom.headroom_bytes, "reasons": list(oom.reasons)},
    }
