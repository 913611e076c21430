"""Real services beside the agent (Prometheus; anything with a readiness URL), started on
127.0.0.1 ports with their state under a given directory, and stopped."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumon.testing.net import free_port, http_get, wait_for


def require_tool(name: str) -> str:
    """Path of an external tool on PATH; a missing one is an AssertionError (a test that needs
    promtool fails without it, it never skips)."""
    path = shutil.which(name)
    assert path, f"{name} is not installed: run scripts/test, which installs it"
    return path


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


def launch_service(name: str, argv: list[str], log_path: Path, ready_url: str,
                   timeout: float = 30.0) -> subprocess.Popen[bytes]:
    """Start a service logging to ``log_path`` and wait until ``ready_url`` answers 200; if it
    does not, stop it and raise AssertionError with its log."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: process.poll() is None and http_get(ready_url)[0] == 200,
                 timeout=timeout, what=f"{name} readiness")
    except AssertionError:
        terminate(process)
        raise AssertionError(f"{name} did not start:\n{log_path.read_text()}") from None
    return process


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
        """The result vector of an instant query (AssertionError unless it succeeded)."""
        status, body = http_get(f"{self.url}/api/v1/query?" +
                                urllib.parse.urlencode({"query": promql}))
        data = json.loads(body)
        assert status == 200 and data["status"] == "success", data
        return list(data["data"]["result"])

    def stop(self) -> None:
        terminate(self.process)


def start_prometheus(tmp_path: Path, targets: list[str], scrape_interval: str = "1s",
                     rule_files: list[Path] | None = None,
                     alertmanager: str | None = None,
                     scrape_extra: Mapping[str, Any] | None = None) -> PrometheusProcess:
    """Start Prometheus scraping ``targets`` (host:port) into a fresh TSDB under tmp_path;
    ``scrape_extra`` adds fields to the scrape job (scheme, tls_config, basic_auth, ...)."""
    binary = require_tool("prometheus")
    port = free_port()
    config: dict[str, Any] = {
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
