"""The sharded pipeline's real services on 127.0.0.1, as deploy/fleet/ runs them: a central
VictoriaMetrics, shards (a Prometheus server remote-writing, or vmagent), the central vmalert
and Alertmanager. Each is started from the configuration it is given (a test or benchmark
passes deploy/fleet/'s files with local addresses), with its state under a given directory."""

from __future__ import annotations

import copy
import json
import subprocess
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumon.testing.net import free_port, http_get
from gpumon.testing.services import launch_service, require_tool, terminate


@dataclass
class Service:
    """One running service: its process, address and log."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def get_json(self, path: str, timeout: float = 10.0, **params: str) -> Any:
        """The parsed body of a GET (AssertionError unless 200)."""
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        status, body = http_get(self.url + path + query, timeout=timeout)
        assert status == 200, (self.name, path, status, body[:2000])
        return json.loads(body)

    def query(self, promql: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The result vector of an instant query on a Prometheus-compatible API."""
        data = self.get_json("/api/v1/query", timeout=timeout, query=promql)
        assert data["status"] == "success", data
        return list(data["data"]["result"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        terminate(self.process)


def _start(name: str, argv: list[str], state: Path, port: int, ready_path: str) -> Service:
    state.mkdir(parents=True, exist_ok=True)
    log_path = state / f"{name}.log"
    process = launch_service(name, argv, log_path, f"http://127.0.0.1:{port}{ready_path}")
    return Service(name, process, port, log_path)


def start_victoria_metrics(state: Path, *flags: str) -> Service:
    """Single-node VictoriaMetrics; samples visible to queries as soon as they arrive (the
    default hides the last 30 s, for scrapers whose samples trail in); ``flags`` added."""
    port = free_port()
    return _start("victoria-metrics", [
        require_tool("victoria-metrics"), f"-storageDataPath={state / 'vm-data'}",
        f"-httpListenAddr=127.0.0.1:{port}", "-retentionPeriod=1d", "-search.latencyOffset=0s",
        "-search.disableCache", "-loggerLevel=WARN", *flags], state, port, "/health")


def start_prometheus_shard(state: Path, name: str, config: dict[str, Any], targets: Sequence[str],
                           store: Service, rule_files: Sequence[Path], alertmanager: Service,
                           interval: str) -> Service:
    """A shard's Prometheus server from ``config`` (deploy/fleet's shard file): its targets,
    rule files, Alertmanager and remote write pointed here, every interval ``interval``."""
    binary = require_tool("prometheus")
    port = free_port()
    config = copy.deepcopy(config)
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    config["rule_files"] = [str(p) for p in rule_files]
    config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [alertmanager.address]}]}]
    (remote,) = config["remote_write"]
    remote["url"] = f"{store.url}/api/v1/write"
    remote.setdefault("queue_config", {})["batch_send_deadline"] = "1s"
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": list(targets)}]
    path = state / f"{name}.yml"
    state.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))  # JSON is valid YAML
    return _start(name, [binary, f"--config.file={path}", f"--storage.tsdb.path={state / (name + '-tsdb')}",
                         f"--web.listen-address=127.0.0.1:{port}"], state, port, "/-/ready")


def start_vmagent_shard(state: Path, name: str, config: dict[str, Any], targets: Sequence[str],
                        store: Service, interval: str) -> Service:
    """A shard's vmagent from ``config`` (deploy/fleet's scrape file), scraping ``targets``
    every ``interval`` and writing to ``store``."""
    port = free_port()
    config = copy.deepcopy(config)
    config["global"]["scrape_interval"] = interval
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": list(targets)}]
    path = state / f"{name}.yml"
    state.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return _start(name, [
        require_tool("vmagent"), f"-promscrape.config={path}",
        f"-remoteWrite.url={store.url}/api/v1/write", "-remoteWrite.flushInterval=1s",
        f"-remoteWrite.tmpDataPath={state / (name + '-buffer')}",
        f"-httpListenAddr=127.0.0.1:{port}", "-loggerLevel=WARN"], state, port, "/health")


def start_vmalert(state: Path, flags: Sequence[str], rule_files: Sequence[Path], store: Service,
                  alertmanager: Service, interval: str, name: str = "vmalert") -> Service:
    """A vmalert with deploy/fleet's ``flags`` (the central one, or a shard's): its rules, store,
    Alertmanager and evaluation interval replaced by these. The query string of its
    ``-datasource.url`` (a shard's ``extra_label`` filter) is kept, and it reads alert state back
    from the store only where its flags do."""
    port = free_port()
    local = {"rule", "datasource.url", "remoteWrite.url", "remoteRead.url", "notifier.url",
             "evaluationInterval", "httpListenAddr"}
    given = dict(f.lstrip("-").split("=", 1) for f in flags if "=" in f)
    kept = [f for f in flags if f.lstrip("-").split("=", 1)[0] not in local]
    query = urllib.parse.urlsplit(given.get("datasource.url", "")).query
    reads = [f"-remoteRead.url={store.url}"] if "remoteRead.url" in given else []
    argv = [require_tool("vmalert"), *kept, *(f"-rule={p}" for p in rule_files),
            f"-datasource.url={store.url}/" + (f"?{query}" if query else ""),
            f"-remoteWrite.url={store.url}", *reads, "-remoteWrite.flushInterval=1s",
            f"-evaluationInterval={interval}", f"-httpListenAddr=127.0.0.1:{port}",
            f"-notifier.url={alertmanager.url}", "-loggerLevel=WARN"]
    return _start(name, argv, state, port, "/health")


def start_alertmanager(state: Path) -> Service:
    """Alertmanager, clustering off, holding what it is sent (its one receiver does nothing)."""
    port = free_port()
    config = {"route": {"receiver": "none", "group_by": ["alertname"]},
              "receivers": [{"name": "none"}]}
    state.mkdir(parents=True, exist_ok=True)
    path = state / "alertmanager.yml"
    path.write_text(json.dumps(config))
    return _start("alertmanager", [
        require_tool("prometheus-alertmanager"), f"--config.file={path}",
        f"--storage.path={state / 'am-data'}", f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address="], state, port, "/-/ready")
