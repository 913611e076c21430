"""Test helpers: a real agent in a subprocess, a real Prometheus, and scrape parsing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent

Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for(predicate: Any, timeout: float = 15.0, interval: float = 0.1,
             what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (OSError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last result: {last!r}")


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """{(sample name, labels): value} of a text exposition."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def values(metrics: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> list[float]:
    """Values of every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return [v for (n, ls), v in metrics.items() if n == name and want <= set(ls)]


def value(metrics: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    """The single value of ``name`` with ``labels``; fails if absent or ambiguous."""
    found = values(metrics, name, **labels)
    assert len(found) == 1, f"{name}{labels}: expected one series, found {found}"
    return found[0]


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

    def scrape(self) -> str:
        status, body = http_get(self.url + "/metrics")
        assert status == 200, body
        return body.decode()

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        return parse_metrics(self.scrape())

    def json(self, path: str) -> tuple[int, Any]:
        status, body = http_get(self.url + path)
        return status, json.loads(body)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def agent_env(lib_dir: Path | None = None, scenario: Path | None = None,
              extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for an agent subprocess, optionally loading the fake NVML."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMON_")}
    env.pop("FAKE_NVML_SCENARIO", None)
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = str(lib_dir)
    else:
        # Make sure no real or fake library is found.
        env["LD_LIBRARY_PATH"] = ""
    if scenario is not None:
        env["FAKE_NVML_SCENARIO"] = str(scenario)
    env.update(extra or {})
    return env


def start_agent(tmp_path: Path, *args: str, env: Mapping[str, str] | None = None,
                wait_ready: bool = True, port: int | None = None) -> AgentProcess:
    """Start ``gpumon agent`` on a free port with its socket under ``tmp_path``."""
    port = port or free_port()
    socket_path = tmp_path / f"ingest-{port}.sock"
    log_path = tmp_path / f"agent-{port}.log"
    command = [sys.executable, "-m", "gpumon.cli", "agent", "--address", "127.0.0.1",
               "--port", str(port), "--socket", str(socket_path), *args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(env) if env is not None else agent_env(), cwd=ROOT)
    agent = AgentProcess(process, port, socket_path, log_path)
    if wait_ready:
        try:
            wait_for(lambda: process.poll() is None and http_get(agent.url + "/readyz")[0] == 200,
                     what="agent readiness")
        except AssertionError:
            agent.stop()
            raise AssertionError(f"agent did not become ready; log:\n{agent.log()}") from None
    return agent


def require_tool(name: str) -> str:
    """Path of an external tool the test needs; a missing one fails the test (never skips)."""
    path = shutil.which(name)
    assert path, f"{name} is not installed: run scripts/test, which installs it"
    return path


@dataclass
class PrometheusProcess:
    """A real Prometheus server on 127.0.0.1."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def query(self, promql: str) -> list[dict[str, Any]]:
        status, body = http_get(f"{self.url}/api/v1/query?" +
                                urllib.parse.urlencode({"query": promql}))
        data = json.loads(body)
        assert status == 200 and data["status"] == "success", data
        return list(data["data"]["result"])

    def stop(self) -> None:
        terminate(self.process)


def terminate(process: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    """SIGTERM a service, SIGKILL it if it lingers; its exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def start_prometheus(tmp_path: Path, targets: list[str], scrape_interval: str = "1s",
                     rule_files: list[Path] | None = None,
                     alertmanager: str | None = None,
                     scrape_extra: Mapping[str, Any] | None = None) -> PrometheusProcess:
    """Start Prometheus scraping ``targets`` (host:port) into a fresh TSDB under tmp_path;
    ``scrape_extra`` adds fields to the scrape job (scheme, tls_config, basic_auth, ...)."""
    binary = require_tool("prometheus")
    port = free_port()
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{"job_name": "gpumon", "static_configs": [{"targets": targets}],
                            **(scrape_extra or {})}],
    }
    if rule_files:
        config["rule_files"] = [str(p) for p in rule_files]
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    config_path = tmp_path / f"prometheus-{port}.yml"
    config_path.write_text(json.dumps(config))  # JSON is valid YAML
    log_path = tmp_path / f"prometheus-{port}.log"
    process = launch_service(
        "prometheus",
        [binary, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / f'tsdb-{port}'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        log_path, f"http://127.0.0.1:{port}/-/ready")
    return PrometheusProcess(process, port, log_path)


def launch_service(name: str, argv: list[str], log_path: Path, ready_url: str) -> subprocess.Popen[bytes]:
    """Start a service logging to ``log_path`` and wait until ``ready_url`` answers 200; if it
    does not, stop it and fail with its log."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: process.poll() is None and http_get(ready_url)[0] == 200,
                 timeout=30, what=f"{name} readiness")
    except AssertionError:
        terminate(process)
        raise AssertionError(f"{name} did not start:\n{log_path.read_text()}") from None
    return process


@contextmanager
def library_agent(socket_path: Path, **config: Any) -> Iterator[Any]:
    """An Agent used as a library, on 127.0.0.1 and a free port; stopped on exit."""
    from gpumon.agent import Agent
    from gpumon.agent.config import AgentConfig

    node = Agent(AgentConfig(address="127.0.0.1", port=0, socket=str(socket_path), **config))
    node.start()
    try:
        yield node
    finally:
        node.stop()


def scrape_text(agent: Any, timeout: float = 5.0) -> str:
    """The /metrics body of an in-process agent (asserts HTTP 200)."""
    status, body = http_get(f"http://127.0.0.1:{agent.port}/metrics", timeout=timeout)
    assert status == 200, body
    return body.decode()


def scrape_metrics(agent: Any, timeout: float = 5.0) -> Metrics:
    """The parsed /metrics of an in-process agent."""
    return parse_metrics(scrape_text(agent, timeout))
