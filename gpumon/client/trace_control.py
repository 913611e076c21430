"""A monitor's trace channel: the agent asks a rank for its next K steps under ``torch.profiler``.

The path (docs/architecture.md §5.2). Each monitor that sends to the agent's socket binds one
more Unix datagram socket, in the abstract namespace, named from the agent's socket path, the
run and the rank (``channel_address``): the agent finds it without being told, nothing is
created on disk, and it goes away with the process. The monitor's sender thread, which wakes
every 0.25 s anyway, reads it without blocking (``TraceControl.poll``); the training thread
never touches it. A request is taken only from the agent (the owner of its socket file), root
or the job's own user, as the kernel tells them (SCM_CREDENTIALS); the answers go back to the
address the request came from.

A request attaches ``Tracer`` (``gpumon.client.watchers.trace``), the step extension that
profiles the steps and hands the stopped profiler back to a writer thread here. The writer
adds gpumon's phase ranges (from the stamps, and ``data`` from the step records this rank
sends meanwhile) and the collectives the communication watcher timed, compresses it, writes
it with the job owner's permissions (0600) into the directory the agent named, and tells the
agent.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol, cast

from gpumon.client.watchers.trace import Tracer, TraceRequest
from gpumon.client.watchers.trace_file import TracedStep, step_number, write_trace
from gpumon.client.watchers.trace_tap import RecordTap
from gpumon.wire.traces import MAX_TRACE_STEPS, channel_address, trace_file_name

if TYPE_CHECKING:
    from gpumon.client.core.cuda_clock import CudaClock
    from gpumon.client.core.extensions import Extensions
    from gpumon.client.core.transport import Transport
    from gpumon.client.watchers.trace_clock import TraceClock

ARM_TIMEOUT_S = 60.0
"""A rank that runs no step this long after accepting gives the request up."""
RECORDS_WAIT_S = 2.0
"""How long the writer waits for the traced steps' records (data seconds, step numbers)."""
CLOSE_WAIT_S = 10.0
"""How long closing (the process exiting) waits for a trace being written, so it is answered."""
_CREDENTIALS = struct.Struct("iII")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class TracedCore(Protocol):
    """What the channel reads and sets of the monitor's step core (``HookCore``)."""

    @property
    def steps(self) -> int: ...

    @property
    def step_origin(self) -> float | None: ...

    def set_cuda(self, clock: CudaClock | None) -> None: ...


class TracedSender(Protocol):
    """What the channel swaps on the monitor's sender (``Sender``): the clock that resolves the
    stamped steps and the transport the traced steps' records leave through."""

    clock: CudaClock | None
    transport: Transport


class TraceControl:
    """A monitor's trace channel: polled on the sender thread, hands requests to ``Tracer``.

    It holds what it reads and swaps of the monitor, never the monitor: its core
    (``TracedCore``), its sender (``TracedSender``), its extension point and a callable giving
    its CUDA clock.
    """

    def __init__(self, socket_path: str, run: str, rank: int, world: int | None,
                 core: TracedCore, sender: TracedSender, extensions: Extensions,
                 cuda_clock: Callable[[], CudaClock | None]) -> None:
        self.run, self.rank, self.world = run, rank, world
        self._socket_path = socket_path
        self._core, self._sender, self._extensions = core, sender, extensions
        self.cuda_clock = cuda_clock
        self._tracer: Tracer | None = None
        self._lock = threading.Lock()
        self._busy: TraceRequest | None = None  # accepted and not answered done/error yet
        self._exports = threading.Event()  # set while a writer thread exports a trace
        self._writer: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.problem: str | None = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(channel_address(socket_path, run, rank))
            self._sock = sock
        except OSError as exc:  # another process holds this run and rank's channel
            sock.close()
            self.problem = f"trace channel unavailable: {exc.strerror or exc}"

    def core_steps(self) -> int:
        return int(self._core.steps)

    def core_step_origin(self) -> float | None:
        origin = self._core.step_origin
        return None if origin is None else float(origin)

    def close(self, ending: bool = False) -> None:
        """Stop taking requests. ``ending`` (the monitor closing, on the training thread or at
        exit): first end a trace under way, wait up to ``CLOSE_WAIT_S`` for one being written,
        and answer a request no step took up, so the agent hears of each."""
        if ending:
            tracer = self._tracer
            if tracer is not None:
                tracer.end()
            writer = self._writer
            if writer is not None:
                writer.join(CLOSE_WAIT_S)
            busy = self._busy
            if busy is not None and not self._exports.is_set():
                if tracer is not None and tracer.request is busy:
                    tracer.request = None
                self.reply(busy, "error", reason="ended",
                           message="the process ended before its traced steps did")
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- sender thread ------------------------------------------------------------------

    def poll(self) -> None:
        """Read waiting requests (never blocks); give up one whose rank ran no step."""
        sock = self._sock
        if sock is None:
            return
        busy = self._busy
        tracer = self._tracer
        if (busy is not None and tracer is not None and tracer.request is busy
                and time.monotonic() - busy.accepted_at > ARM_TIMEOUT_S):
            tracer.request = None
            self._busy = None
            self.reply(busy, "error", reason="no_step",
                       message=f"no step began in {ARM_TIMEOUT_S:g} s: the rank is stalled or idle")
        for _ in range(8):
            try:
                data, ancdata, _flags, address = sock.recvmsg(4096, socket.CMSG_SPACE(_CREDENTIALS.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self._request(data, ancdata, address)

    def _request(self, data: bytes, ancdata: list[Any], address: Any) -> None:
        uid = _sender_uid(ancdata)
        if not address:
            return  # nowhere to answer
        if uid is None or uid not in self._trusted_uids():
            self._send(address, {"state": "refused", "reason": "not_allowed", "message":
                                 "trace requests are taken from the agent, root or the job's user"})
            return
        try:
            message = json.loads(data)
            ident = str(message["id"])[:64]
            steps = int(message.get("steps", 3))
            directory = str(message["dir"])
        except (ValueError, KeyError, TypeError):
            self._send(address, {"state": "refused", "reason": "bad_request"})
            return
        if not 1 <= steps <= MAX_TRACE_STEPS or not os.path.isabs(directory):
            self._send(address, {"id": ident, "state": "refused", "reason": "bad_request"})
            return
        busy = self._busy
        if busy is not None:
            self._send(address, {"id": ident, "state": "busy", "trace": busy.ident, "run": self.run,
                                 "rank": self.rank})
            return
        request = TraceRequest(ident, steps, directory, address)
        self._busy = request
        tracer = self._tracer
        if tracer is None:
            tracer = self._tracer = self._extensions.attach(Tracer, lambda: Tracer(self))
        tracer.request = request
        self._extensions.wake()
        self.reply(request, "accepted", steps=steps)

    def _trusted_uids(self) -> set[int]:
        trusted = {0, os.getuid()}
        try:
            trusted.add(os.stat(self._socket_path).st_uid)
        except OSError:
            pass
        return trusted

    def reply(self, request: TraceRequest, state: str, **fields: Any) -> None:
        """Answer the agent about ``request``; a final answer frees the channel."""
        if state in ("done", "error"):
            with self._lock:
                if self._busy is request:
                    self._busy = None
        self._send(request.reply_to, {"id": request.ident, "state": state, "run": self.run,
                                      "rank": self.rank, "pid": os.getpid(), **fields})

    def _send(self, address: Any, message: dict[str, Any]) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            sock.sendto(json.dumps(message).encode(), address)
        except OSError:
            pass  # the agent went away: it times the request out itself

    # -- training thread --------------------------------------------------------------------

    def install_clock(self, clock: TraceClock) -> None:
        """Stamp every phase boundary from the next step on; the sender resolves the stamps."""
        # A TraceClock stands in for the CUDA clock: it answers each call the core and the
        # sender make of one, passing the CUDA events through to the real clock.
        stand_in = cast("CudaClock", clock)
        self._sender.clock = stand_in
        self._core.set_cuda(stand_in)

    def restore_clock(self) -> None:
        """Give the core its own CUDA clock back (the sender keeps the trace clock, which
        passes everything through, until stamped steps are all resolved)."""
        self._core.set_cuda(self.cuda_clock())

    def start_tap(self) -> RecordTap:
        """Keep this rank's step records as they are sent, for the steps being traced."""
        tap = RecordTap(self.run, self.rank)
        self._sender.transport = tap.wrap(self._sender.transport)
        return tap

    def stop_tap(self, tap: RecordTap) -> None:
        if self._sender.transport is tap:
            self._sender.transport = tap.inner

    def written(self, request: TraceRequest, prof: Any, steps: list[TracedStep],
                clock: TraceClock, tap: RecordTap) -> None:
        """Hand a stopped profiler to a writer thread (exporting costs the loop nothing)."""
        self._exports.set()
        thread = threading.Thread(target=self._write_then_free, name="gpumon-trace-writer",
                                  args=(request, prof, steps, clock, tap), daemon=True)
        self._writer = thread
        thread.start()

    def exporting(self) -> bool:
        """Whether a stopped profiler's results are still being written."""
        return self._exports.is_set()

    def _write_then_free(self, request: TraceRequest, prof: Any, steps: list[TracedStep],
                         clock: TraceClock, tap: RecordTap) -> None:
        try:
            self._write(request, prof, steps, clock, tap)
        finally:
            self._exports.clear()

    def _write(self, request: TraceRequest, prof: Any, steps: list[TracedStep],
               clock: TraceClock, tap: RecordTap) -> None:
        first = steps[0].seq if steps else self.core_steps()
        deadline = perf_counter() + RECORDS_WAIT_S
        while steps and perf_counter() < deadline and not tap.covers(steps[-1]):
            time.sleep(0.05)
        time.sleep(0.3)  # its record may have left in the flush after the one that covered it
        self.stop_tap(tap)
        ranges = list(clock.collect or ())
        clock.collect = None
        records = tap.records
        if records:
            first = step_number(records, steps[0]) if steps else first
        path = os.path.join(request.directory, trace_file_name(self.run, self.rank, first))
        try:
            size = write_trace(prof, path, steps, ranges, records, self.rank, self.world)
        except OSError as exc:
            reason = "no_space" if exc.errno in _NO_SPACE else "write_error"
            self.reply(request, "error", reason=reason, message=str(exc)[:300])
            return
        except Exception as exc:
            self.reply(request, "error", reason="profiler_error",
                       message=f"{type(exc).__name__}: {exc}"[:300])
            return
        self.reply(request, "done", path=path, bytes=size, first_step=first, steps=len(steps))


def _sender_uid(ancdata: list[Any]) -> int | None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDENTIALS.size:
            return int(_CREDENTIALS.unpack_from(data)[1])
    return None
