"""A real ``gpumon agent``: in a subprocess on a free port with its socket under a given
directory, or in-process as a library; scraped and stopped the same way everywhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gpumon
from gpumon.testing.fakenvml import fake_nvml_env
from gpumon.testing.metrics import Metrics, parse_metrics
from gpumon.testing.net import free_port, http_get, wait_for

IMPORT_ROOT = Path(gpumon.__file__).resolve().parent.parent
"""The directory holding the gpumon package this process imported: a ``python -m gpumon.cli``
started there imports the same gpumon (a work tree's, not an installed copy)."""


@dataclass
class AgentProcess:
    """A running ``gpumon agent`` subprocess."""

    process: subprocess.Popen[bytes]
    port: int
    socket_path: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def scrape(self, timeout: float = 5.0) -> str:
        """The /metrics body (AssertionError on any status but 200)."""
        status, body = http_get(self.url + "/metrics", timeout)
        assert status == 200, body
        return body.decode()

    def metrics(self, timeout: float = 5.0) -> Metrics:
        """The parsed /metrics."""
        return parse_metrics(self.scrape(timeout))

    def json(self, path: str, timeout: float = 5.0) -> tuple[int, Any]:
        """(status, parsed body) of a GET on ``path`` (/readyz, /api/v1/snapshot, ...)."""
        status, body = http_get(self.url + path, timeout)
        return status, json.loads(body)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Send ``sig`` and wait; SIGKILL (its whole process group, if it has its own) when it
        lingers. Its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL now, with its children if it leads its own session."""
        if self.process.poll() is None:
            try:
                if os.getpgid(self.process.pid) == self.process.pid:
                    os.killpg(self.process.pid, signal.SIGKILL)
                else:
                    self.process.kill()
            except ProcessLookupError:
                pass
        self.process.wait()


def agent_env(lib_dir: Path | None = None, scenario: Path | None = None,
              extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for an agent subprocess: none of this process's GPUMON_* settings, and
    NVML from the fake library in ``lib_dir`` with ``scenario``, or no library at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMON_")}
    env["LD_LIBRARY_PATH"] = ""  # only the library named here, or none: never a real one
    env = fake_nvml_env(None if lib_dir is None else lib_dir / "libnvidia-ml.so.1", scenario,
                        base=env)
    env.update(extra or {})
    return env


class _Exited(Exception):
    """The agent process ended while it was awaited."""


def start_agent(tmp_path: Path, *args: str, env: Mapping[str, str] | None = None,
                wait_ready: bool = True, port: int | None = None,
                log_path: Path | None = None, socket_path: Path | None = None,
                ready_timeout: float = 15.0, new_session: bool = False) -> AgentProcess:
    """Start ``gpumon agent`` on 127.0.0.1 and a free port with its socket and log under
    ``tmp_path`` (unless given); with ``wait_ready``, return once /readyz answers 200, or
    stop it and raise AssertionError with its log. ``new_session`` makes it lead its own
    process group, so a watchdog can kill it with whatever it started."""
    port = port or free_port()
    socket_path = socket_path or tmp_path / f"ingest-{port}.sock"
    log_path = log_path or tmp_path / f"agent-{port}.log"
    command = [sys.executable, "-m", "gpumon.cli", "agent", "--address", "127.0.0.1",
               "--port", str(port), "--socket", str(socket_path), *args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL,
                                   env=dict(env) if env is not None else agent_env(),
                                   cwd=IMPORT_ROOT, start_new_session=new_session)
    agent = AgentProcess(process, port, socket_path, log_path)
    if wait_ready:

        def ready() -> bool:
            if process.poll() is not None:
                raise _Exited  # an agent that exited will not become ready: stop waiting
            return http_get(agent.url + "/readyz")[0] == 200

        try:
            wait_for(ready, timeout=ready_timeout, what="agent readiness")
        except (AssertionError, _Exited):
            agent.stop()
            raise AssertionError(f"agent did not become ready (exit status "
                                 f"{process.returncode}); log:\n{agent.log()}") from None
    return agent


@contextmanager
def library_agent(socket_path: Path, **config: Any) -> Iterator[Any]:
    """An Agent used as a library, on a free port of 127.0.0.1 (of ``address`` when given);
    stopped on exit."""
    from gpumon.agent.config import AgentConfig
    from gpumon.agent.lifecycle import Agent

    node = Agent(AgentConfig(**{"address": "127.0.0.1", "port": 0, "socket": str(socket_path),
                                **config}))
    node.start()
    try:
        yield node
    finally:
        node.stop()


def scrape_text(agent: Any, timeout: float = 5.0) -> str:
    """The /metrics body of an in-process agent (AssertionError on any status but 200)."""
    status, body = http_get(f"http://127.0.0.1:{agent.port}/metrics", timeout=timeout)
    assert status == 200, body
    return body.decode()


def scrape_metrics(agent: Any, timeout: float = 5.0) -> Metrics:
    """The parsed /metrics of an in-process agent."""
    return parse_metrics(scrape_text(agent, timeout))
