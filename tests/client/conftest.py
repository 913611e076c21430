"""Fixtures for the client tests: a real Unix datagram receiver standing in for the agent, and a
clock the test moves by hand."""

from __future__ import annotations

import array
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumon.wire import EventRecord, HelloRecord, Record, StepRecord, decode_datagram


class Receiver:
    """Binds a datagram socket and decodes what arrives, as the agent's ingest would."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[Record] = []
        self.rejected: list[str] = []
        self.rings: list[bytes] = []
        """Ring hand-overs (datagrams carrying a descriptor), which ingest takes apart."""
        self.arrivals: list[float] = []
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self, read: bool = True) -> Receiver:
        """Bind the socket; with ``read=False`` nobody ever reads it (a stuck agent)."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self.path))
        self._sock.settimeout(0.05)
        if read:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Close and remove the socket."""
        sock, self._sock = self._sock, None
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if sock is not None:
            sock.close()
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        while self._sock is not None:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(1 << 16, socket.CMSG_SPACE(64))
            except TimeoutError:
                continue
            except OSError:
                return
            fds = [fd for level, kind, raw in ancillary
                   if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
                   for fd in array.array("i", raw[:len(raw) - len(raw) % 4])]
            if fds:
                for fd in fds:
                    os.close(fd)
                with self._lock:
                    self.rings.append(data)
                continue
            result = decode_datagram(data)
            with self._lock:
                self.records.extend(result.records)
                self.rejected.extend(result.rejected)
                self.arrivals.extend(time.monotonic() for _ in result.records)

    def steps(self) -> list[StepRecord]:
        with self._lock:
            return [r for r in self.records if isinstance(r, StepRecord)]

    def events(self) -> list[EventRecord]:
        with self._lock:
            return [r for r in self.records if isinstance(r, EventRecord)]

    def hellos(self) -> list[HelloRecord]:
        with self._lock:
            return [r for r in self.records if isinstance(r, HelloRecord)]

    def wait_for_steps(self, count: int, timeout: float = 5.0) -> list[StepRecord]:
        """The step records once at least ``count`` arrived (or what came by the timeout)."""
        deadline = time.monotonic() + timeout
        while len(self.steps()) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.steps()


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    """A socket path short enough for AF_UNIX (108 bytes), in tmp_path when it fits."""
    if len(str(tmp_path / "ingest.sock")) < 100:
        yield tmp_path / "ingest.sock"
    else:
        with tempfile.TemporaryDirectory(prefix="gpumon") as short:
            yield Path(short) / "ingest.sock"


@pytest.fixture
def receiver(socket_path: Path) -> Iterator[Receiver]:
    """A reading receiver on ``socket_path``."""
    r = Receiver(socket_path).start()
    yield r
    r.stop()


class ManualClock:
    """A clock that moves only when the test moves it, for the pure-Python code that reads
    ``perf_counter`` and ``thread_time`` by those names: wall seconds, and the calling thread's
    CPU seconds (which run with the wall clock unless told otherwise)."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s
        self.cpu_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def thread_time(self) -> float:
        return self.cpu_s

    def advance(self, seconds: float, cpu_s: float | None = None) -> None:
        """Let ``seconds`` pass, ``cpu_s`` of them on a CPU (default: all)."""
        self.now_s += seconds
        self.cpu_s += seconds if cpu_s is None else cpu_s

    def install(self, monkeypatch: pytest.MonkeyPatch, module: str) -> ManualClock:
        """Stand in for ``module``'s ``perf_counter`` (and ``thread_time``, where it has one)."""
        monkeypatch.setattr(f"{module}.perf_counter", self)
        if hasattr(sys.modules[module], "thread_time"):
            monkeypatch.setattr(f"{module}.thread_time", self.thread_time)
        return self


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    """A gloo process group of one rank for a test module (``usefixtures`` it), destroyed after."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'store'}", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture
def ledger() -> Iterator[object]:
    """A communication ledger the tap reports to, for one test."""
    from gpumon.client.comm.ledger import CommLedger
    from gpumon.client.comm.tap import tap_into, untap

    led = CommLedger()
    assert tap_into(led)
    yield led
    untap(led)
