"""Profiler traces the agent asks of the ranks on its node: on request, and when a rule fires.

A request goes to the rank's trace channel (``gpumon.client.trace_control``: an abstract Unix
datagram socket named from the ingest socket's path, the run and the rank) from this desk's
own socket, whose answers the kernel stamps with the sender's uid: an answer counts only from
the uid that sends the rank's steps (or root), and a finished trace only when its file is a
regular file in the trace directory owned by that uid. The rank answers ``accepted`` within a
sender wake-up (0.25 s), then ``done`` with the file's path or ``error`` with a reason. Every
request for a rank that has one in flight gets that one back: two requests give one trace.

The directory (``trace_dir``) is made by the agent, sticky and writable by all (as ``/tmp``):
each job writes its own files there with mode 0600, and the agent removes the oldest once they
hold more than ``trace_max_bytes``. A directory the agent does not own is refused, so no other
user can take its place.

The automatic rule (``trace_auto``, off by default: a trace slows the traced steps and writes
code paths and shapes to the node's disk, which a site chooses to keep) asks for one trace
when a rank turns straggler, or its verdict is communication or host for
``trace_auto_windows`` windows in a row, at most once per rank every
``trace_auto_every_seconds``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from gpumon.agent.config import AgentConfig
from gpumon.agent.trace_files import TRACE_FILE, trace_files
from gpumon.analysis.bottleneck import Bottleneck
from gpumon.analysis.stream import RankAnalysis
from gpumon.errors import GpumonError
from gpumon.export.exposition import CounterFamily
from gpumon.state.ranks import RankStore
from gpumon.wire.traces import MAX_TRACE_STEPS, channel_address

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 5.0
"""A rank that does not accept within this long is not listening (stalled sender, old client)."""
TRACE_TIMEOUT_S = 120.0
"""An accepted trace not done by then is given up (the rank stopped stepping)."""
KEEP_TRACES = 256
"""Requests remembered for the listing (the files themselves are listed from the disk)."""
AUTO_VERDICTS = (Bottleneck.COMMUNICATION, Bottleneck.HOST)
_CREDENTIALS = struct.Struct("iII")


class TraceError(GpumonError):
    """A request the agent refuses: ``code`` is the HTTP status, the message says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Trace:
    """One request for one rank, and what became of it."""

    id: str
    run: str
    rank: int
    steps: int
    trigger: str
    state: str = "requested"
    """requested, accepted, done or failed."""
    requested_at: float = field(default_factory=time.time)
    path: str | None = None
    bytes: int | None = None
    first_step: int | None = None
    reason: str | None = None
    message: str | None = None
    _monotonic: float = field(default_factory=time.monotonic, repr=False)
    _uid: int | None = field(default=None, repr=False)

    def public(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


@dataclass(frozen=True)
class TraceSettings:
    directory: str
    max_bytes: int
    steps: int
    auto: bool
    auto_windows: int
    auto_every_s: float


class TraceDesk:
    """Sends trace requests, follows their answers, lists and counts the traces (a collector
    for the agent's registry), and keeps the directory within its bound. The rank store says
    which ranks report to this agent and the uid each one's steps come from."""

    def __init__(self, settings: TraceSettings, ingest_socket: str, rank_store: RankStore) -> None:
        self.settings = settings
        self._ingest_socket = ingest_socket
        self._rank_store = rank_store
        self._lock = threading.Lock()
        self._traces: OrderedDict[str, Trace] = OrderedDict()
        self._in_flight: dict[tuple[str, int], Trace] = {}
        self.totals: dict[tuple[str, int, str], int] = {}
        self.errors: dict[str, int] = {}
        self._latest: OrderedDict[tuple[str, int], Trace] = OrderedDict()
        self._auto_last: dict[tuple[str, int], float] = {}
        self._auto_windows: dict[tuple[str, int], tuple[int | None, int, bool]] = {}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(b"")  # an abstract address of the kernel's choosing, to be answered at
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._receive, name="gpumon-traces", daemon=True)
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._wake_w.send(b"\0")
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()

    # -- requests ---------------------------------------------------------------------

    def request(self, run: str, rank: int | None, steps: int | None = None, trigger: str = "request",
                requester_uid: int | None = None) -> list[Trace]:
        """Ask ``rank`` of ``run`` (every rank of it on this node: ``None``) for a trace of its
        next ``steps`` steps. ``requester_uid``: the local user asking, who must be root, the
        agent's user or the job's (``None``: an authenticated or the agent's own request)."""
        steps = self.settings.steps if steps is None else steps
        if not 1 <= steps <= MAX_TRACE_STEPS:
            raise TraceError(400, f"steps must be between 1 and {MAX_TRACE_STEPS}")
        owners = {t.rank: t.uid for t in self._rank_store.ranks() if t.run == run}
        ranks = sorted(owners) if rank is None else [rank]
        if not ranks:
            raise TraceError(404, f"no rank of run {run!r} reports to this agent")
        self._check_directory()
        out = []
        for r in ranks:
            uid = owners.get(r)
            if r not in owners or uid is None:
                raise TraceError(404, f"rank {r} of run {run!r} does not report to this agent")
            if requester_uid is not None and requester_uid not in (0, os.getuid(), uid):
                raise TraceError(403, f"uid {requester_uid} may not trace rank {r} of run {run!r}: "
                                      "its traces hold the job's code paths and shapes")
            out.append(self._send(run, r, steps, trigger, uid))
        return out

    def _send(self, run: str, rank: int, steps: int, trigger: str, uid: int) -> Trace:
        with self._lock:
            self._expire_locked()
            current = self._in_flight.get((run, rank))
            if current is not None:
                return current
            trace = Trace(uuid.uuid4().hex[:16], run, rank, steps, trigger, _uid=uid)
            self._remember_locked(trace)
        self._wake_w.send(b"\1")
        message = {"op": "trace", "id": trace.id, "steps": steps, "dir": self.settings.directory}
        try:
            self._sock.sendto(json.dumps(message).encode(),
                              channel_address(self._ingest_socket, run, rank))
        except OSError as exc:
            # Nobody bound the rank's channel: the process is gone, or it runs a client
            # without traces, or in another network namespace than the agent.
            self._fail(trace, "no_channel", f"no process of rank {rank} of run {run!r} listens "
                       f"for trace requests on this node ({exc.strerror or exc}): it has exited, "
                       "or runs without gpumon's trace channel")
        return trace

    def get(self, trace_id: str) -> Trace | None:
        with self._lock:
            self._expire_locked()
            return self._traces.get(trace_id)

    def listing(self) -> dict[str, Any]:
        """The requests remembered and the trace files on disk, newest first."""
        with self._lock:
            self._expire_locked()
            requests = [t.public() for t in reversed(self._traces.values())]
        return {"directory": self.settings.directory, "requests": requests, "files": self._files()}

    def _files(self) -> list[dict[str, Any]]:
        out = []
        for name, path, st in trace_files(self.settings.directory):
            match = TRACE_FILE.match(name)
            if match is None:
                continue
            out.append({"path": path, "bytes": st.st_size, "mtime": st.st_mtime,
                        "run": match["run"], "rank": int(match["rank"]), "first_step": int(match["step"])})
        return sorted(out, key=lambda f: f["mtime"], reverse=True)

    # -- answers ----------------------------------------------------------------------

    def _receive(self) -> None:
        while not self._stopped:
            # Asleep while nothing is in flight; once a second while something may time out.
            timeout = 1.0 if self._in_flight else None
            try:
                ready, _, _ = select.select([self._sock, self._wake_r], [], [], timeout)
            except (OSError, ValueError):
                return
            if self._stopped:
                return
            if self._wake_r in ready:
                self._wake_r.recv(64)  # a request went out: look at the clock from now on
                continue
            if not ready:
                with self._lock:
                    self._expire_locked()
                continue
            while True:
                try:
                    data, ancdata, _, _ = self._sock.recvmsg(4096, socket.CMSG_SPACE(_CREDENTIALS.size))
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    return
                try:
                    self._answer(data, _uid(ancdata))
                except Exception:  # a bad answer must not end the desk
                    log.debug("trace answer not understood", exc_info=True)
                    self._count_error("bad_answer")

    def _answer(self, data: bytes, uid: int | None) -> None:
        message = json.loads(data)
        with self._lock:
            trace = self._traces.get(str(message.get("id")))
        if trace is None or trace.state in ("done", "failed"):
            return
        if uid is None or uid not in (0, trace._uid):
            self._count_error("not_owner")
            return
        state = message.get("state")
        if state == "accepted":
            with self._lock:
                trace.state = "accepted"
                trace._monotonic = time.monotonic()
        elif state == "busy":  # a trace this agent no longer follows (it timed out), or another's
            self._fail(trace, "busy", f"the rank is still writing trace {message.get('trace')}")
        elif state == "done":
            path = str(message.get("path"))
            problem = self._check_file(path, uid)
            if problem is not None:
                self._fail(trace, "bad_answer", problem)
                return
            with self._lock:
                trace.state, trace.path = "done", path
                trace.bytes = int(message.get("bytes") or 0)
                trace.first_step = message.get("first_step")
                self._in_flight.pop((trace.run, trace.rank), None)
                key = (trace.run, trace.rank, trace.trigger)
                self.totals[key] = self.totals.get(key, 0) + 1
                self._latest[(trace.run, trace.rank)] = trace
                self._latest.move_to_end((trace.run, trace.rank))
                while len(self._latest) > KEEP_TRACES:
                    self._latest.popitem(last=False)
            self.bound_disk(keep=path)
        else:
            self._fail(trace, str(message.get("reason") or "error")[:32],
                       str(message.get("message") or state)[:300])

    def _check_file(self, path: str, uid: int) -> str | None:
        directory = os.path.realpath(self.settings.directory)
        if os.path.dirname(os.path.realpath(path)) != directory:
            return f"{path} is not in the trace directory"
        try:
            st = os.lstat(path)
        except OSError as exc:
            return f"{path}: {exc.strerror}"
        if not stat.S_ISREG(st.st_mode) or (uid != 0 and st.st_uid != uid):
            return f"{path} is not a file of the rank's user"
        return None

    def _fail(self, trace: Trace, reason: str, message: str) -> None:
        with self._lock:
            trace.state, trace.reason, trace.message = "failed", reason, message
            if self._in_flight.get((trace.run, trace.rank)) is trace:
                del self._in_flight[(trace.run, trace.rank)]
        self._count_error(reason)

    def _count_error(self, reason: str) -> None:
        with self._lock:
            self.errors[reason] = self.errors.get(reason, 0) + 1

    def _remember_locked(self, trace: Trace) -> None:
        self._traces[trace.id] = trace
        self._in_flight[(trace.run, trace.rank)] = trace
        while len(self._traces) > KEEP_TRACES:
            self._traces.popitem(last=False)

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for trace in list(self._in_flight.values()):
            waited = now - trace._monotonic
            if trace.state == "requested" and waited > ANSWER_TIMEOUT_S:
                reason, message = "no_answer", (
                    f"rank {trace.rank} did not answer in {ANSWER_TIMEOUT_S:g} s: its process is "
                    "stalled, or its client has no trace channel")
            elif trace.state == "accepted" and waited > TRACE_TIMEOUT_S:
                reason, message = "timeout", (
                    f"rank {trace.rank} accepted but wrote no trace in {TRACE_TIMEOUT_S:g} s: "
                    "it stopped stepping")
            else:
                continue
            trace.state, trace.reason, trace.message = "failed", reason, message
            del self._in_flight[(trace.run, trace.rank)]
            self.errors[reason] = self.errors.get(reason, 0) + 1

    # -- the directory ----------------------------------------------------------------

    def _check_directory(self) -> None:
        directory = self.settings.directory
        try:
            os.makedirs(directory, mode=0o755, exist_ok=True)
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                raise TraceError(500, f"trace directory {directory} is not a directory of the "
                                      "agent's user: refusing to have jobs write there")
            if stat.S_IMODE(st.st_mode) != 0o1777:
                os.chmod(directory, 0o1777)  # each job writes its own files, 0600
        except OSError as exc:
            raise TraceError(500, f"trace directory {directory}: {exc.strerror or exc}") from exc

    def bound_disk(self, keep: str | None = None) -> None:
        """Remove the oldest trace files while they hold more than ``max_bytes`` (never
        ``keep``, the one just written)."""
        files = sorted(trace_files(self.settings.directory), key=lambda f: f[2].st_mtime)
        total = sum(st.st_size for _, _, st in files)
        for _, path, st in files:
            if total <= self.settings.max_bytes:
                break
            if path == keep:
                continue
            try:
                os.unlink(path)
                total -= st.st_size
            except OSError:
                self._count_error("remove_failed")

    # -- the automatic rule -----------------------------------------------------------

    def observe(self, analyses: Iterable[RankAnalysis]) -> None:
        """Ask for a trace where the rule says (called by the agent's housekeeping)."""
        settings = self.settings
        if not settings.auto:
            return
        now = time.monotonic()
        for a in analyses:
            key = (a.run, a.rank)
            straggler = a.straggler_cause is not None
            last_step, windows, was_straggler = self._auto_windows.get(key, (None, 0, False))
            if a.verdict is not None and a.verdict_step != last_step:
                windows = windows + 1 if a.verdict.primary in AUTO_VERDICTS else 0
                last_step = a.verdict_step
            self._auto_windows[key] = (last_step, windows, straggler)
            reason = ("straggler" if straggler and not was_straggler
                      else a.verdict.primary.value if windows >= settings.auto_windows and a.verdict
                      else None)
            if reason is None or now - self._auto_last.get(key, -1e18) < settings.auto_every_s:
                continue
            self._auto_last[key] = now
            self._auto_windows[key] = (last_step, 0, straggler)
            try:
                self.request(a.run, a.rank, trigger=reason)
            except TraceError as exc:
                log.info("automatic trace of %s rank %d not asked: %s", a.run, a.rank, exc)

    # -- metrics ----------------------------------------------------------------------

    def describe(self) -> list[Metric]:
        """The families ``collect`` yields: it reads only what the desk holds, no I/O."""
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            totals = dict(self.totals)
            errors = dict(self.errors)
            latest = list(self._latest.values())
        traces = CounterFamily("gpumon_traces", "Profiler traces written by ranks of this node, "
                               "by what asked for them (request, straggler, communication, host).",
                               labels=["run", "rank", "trigger"])
        for (run, rank, trigger), count in sorted(totals.items()):
            traces.add_metric([run, str(rank), trigger], float(count))
        failed = CounterFamily("gpumon_trace_errors", "Trace requests that gave no trace, by reason "
                               "(no_channel, no_answer, timeout, no_torch, no_step, no_space, "
                               "write_error, profiler_error, ended, busy, bad_answer).", labels=["reason"])
        for reason, count in sorted(errors.items()):
            failed.add_metric([reason], float(count))
        info = GaugeMetricFamily("gpumon_trace_info", "The latest trace of each rank: its file "
                                 "(1 while the agent remembers it).",
                                 labels=["run", "rank", "path", "trigger"])
        for trace in latest:
            info.add_metric([trace.run, str(trace.rank), trace.path or "", trace.trigger], 1.0)
        yield traces
        yield failed
        yield info


def _uid(ancdata: list[Any]) -> int | None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDENTIALS.size:
            return int(_CREDENTIALS.unpack_from(data)[1])
    return None


def trace_settings(config: AgentConfig) -> TraceSettings:
    return TraceSettings(config.trace_dir, config.trace_max_bytes, config.trace_steps,
                         config.trace_auto, config.trace_auto_windows,
                         config.trace_auto_every_seconds)


Api = Callable[[str, str, bytes, Any, Any, bool], tuple[int, dict[str, Any]]]
