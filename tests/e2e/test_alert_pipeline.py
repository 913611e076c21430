"""Alerts end to end: simulated demo nodes → real Prometheus (the rules loaded) → real
Alertmanager → a webhook receiver in this test.

Five demo nodes (agent + simulated GPUs + synthetic job through the real hook and socket, as
`gpumon demo` wires them) run at once, each a different story, all scraped by one Prometheus:

* ``leak`` — one node, 2 ranks: a few healthy seconds, then every step's peak grows towards
  capacity. GpumonOOMPredicted must reach the webhook while memory is still growing and below
  capacity.
* ``input`` — one node, 2 ranks starved by their data loader: GpumonInputBound.
* ``straggler`` — one run of 5 ranks over three nodes (ranks 0–1, 2–3, and 4 alone), rank 4
  computing 1.6× slower while the others wait for it in the all-reduce (the simulated job
  reports its collectives through the ``comm`` field, as a watched DDP job does):
  GpumonRankStraggler for rank 4 only. No agent sees it: the two that compare ranks see
  only ranks that wait alike, and rank 4's agent has no peer to compare it with. Only the
  run-wide recording rules can.

The rules are the shipped ones with every duration divided by ``TIME_SCALE`` (see
``compress_rules``); alerts/tests/ checks the real durations with promtool.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpumon.agent.config import AgentConfig
from gpumon.agent.lifecycle import Agent
from gpumon.collectors.process_owner import user_name
from gpumon.sim.gpus import SimulatedSource
from gpumon.sim.job import SimulatedJob
from gpumon.sim.schedule import PhaseKind, parse_schedule
from tests.helpers import (
    ROOT,
    PrometheusProcess,
    free_port,
    launch_service,
    require_tool,
    start_prometheus,
    terminate,
    wait_for,
)

pytestmark = pytest.mark.waits

RULE_FILE = ROOT / "alerts" / "gpumon.rules.yml"
TIME_SCALE = 30
"""Every duration of the rules ÷ this: ``for: 10m`` becomes 20 s, ``[5m]`` 10 s, ``offset 10m`` 20 s."""
INTERVAL_S = 0.5  # the agents' GPU polling (and analysis) interval
ALERT_TIMEOUT_S = 150.0  # from the start of the nodes; every alert is expected within ~60 s

WARMUP_S = 5  # healthy steps before the leak starts
LEAK_S = 90  # the leak's peak grows from 60 % to 99 % of capacity over this long
LEAK = f"""
[[phase]]
kind = "compute"
seconds = {WARMUP_S}

[[phase]]
kind = "leak"
seconds = {LEAK_S}
peak_ratio = 0.99
"""
INPUT = """
[[phase]]
kind = "input"
seconds = 300
"""
STRAGGLER_RANK = 4
STRAGGLER_WORLD = 5
STRAGGLER = f"""
[[phase]]
kind = "straggler"
seconds = 300
rank = {STRAGGLER_RANK}
slowdown = 1.6
"""

# --- the time-compressed rules --------------------------------------------------------------

_DURATION = r"(?:\d+(?:ms|[smhdwy]))+"
_WINDOW = re.compile(rf"(\[|(?<=[smhdwy]):|\boffset\s+)({_DURATION})(?=[\]\s):])")
_PART = re.compile(r"(\d+)(ms|[smhdwy])")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "y": 365 * 86400}


def duration_s(text: str) -> float:
    """Seconds of a Prometheus duration such as ``5m`` or ``1h30m``."""
    assert re.fullmatch(_DURATION, text), f"not a duration: {text!r}"
    return sum(int(n) * _UNIT_S[unit] for n, unit in _PART.findall(text))


def _format_s(seconds: float) -> str:
    ms = round(seconds * 1000)
    assert ms > 0, f"{seconds} s is below Prometheus' resolution"
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def compress_rules(doc: dict[str, Any], scale: int) -> dict[str, Any]:
    """A copy of a rule file with every duration divided by ``scale``: each rule's ``for:``,
    and in each expression every range window (``[5m]``), subquery (``[6h:1m]``) and
    ``offset``.

    Why: the shipped rules wait as long as production needs (``for: 15m`` over 5- and
    10-minute windows) and a test cannot. Dividing every duration by the same factor keeps
    each rule's logic — a condition must hold for a while, over windows of comparable
    lengths — while everything else stays exactly as shipped: names, thresholds (including
    those in seconds, like ``gpumon_oom_predicted_seconds < 1800``), labels and annotations
    (whose text still says "15 minutes"). ``test_compression_changes_only_durations`` holds
    the transform to that; promtool's unit tests (alerts/tests/) cover the real durations.
    """

    def scaled(text: str) -> str:
        return _format_s(duration_s(text) / scale)

    copy: dict[str, Any] = json.loads(json.dumps(doc))
    for group in copy["groups"]:
        for rule in group["rules"]:
            rule["expr"] = _WINDOW.sub(lambda m: m[1] + scaled(m[2]), rule["expr"])
            if "for" in rule:
                rule["for"] = scaled(rule["for"])
    return copy


def _without_durations(expr: str) -> str:
    return _WINDOW.sub(lambda m: m[1] + "<d>", expr)


def _shipped_rules() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(RULE_FILE.read_text())
    return doc


def test_compression_changes_only_durations(tmp_path: Path) -> None:
    shipped = _shipped_rules()
    compressed = compress_rules(shipped, TIME_SCALE)
    assert compressed != shipped and shipped == _shipped_rules()  # a copy; the input untouched
    pairs = [(a, b) for g, h in zip(shipped["groups"], compressed["groups"], strict=True)
             for a, b in zip(g["rules"], h["rules"], strict=True)]
    assert [g["name"] for g in shipped["groups"]] == [g["name"] for g in compressed["groups"]]
    windows = 0
    for before, after in pairs:
        name = before.get("alert") or before["record"]
        assert set(before) == set(after), name
        for key in set(before) - {"expr", "for"}:
            assert before[key] == after[key], (name, key)
        assert _without_durations(before["expr"]) == _without_durations(after["expr"]), name
        old = [duration_s(m[2]) for m in _WINDOW.finditer(before["expr"])]
        new = [duration_s(m[2]) for m in _WINDOW.finditer(after["expr"])]
        assert new == [pytest.approx(s / TIME_SCALE) for s in old], name
        # Nothing in brackets escaped the transform (a subquery's range and resolution too).
        brackets = re.findall(r"\[([^\]]*)\]", _without_durations(after["expr"]))
        assert set(brackets) <= {"<d>", "<d>:<d>"}, (name, brackets)
        if "for" in before:
            assert duration_s(after["for"]) == pytest.approx(duration_s(before["for"]) / TIME_SCALE)
        windows += len(old)
    alerts = {rule["alert"] for rule, _ in pairs if "alert" in rule}
    assert {"GpumonOOMPredicted", "GpumonInputBound", "GpumonRankStraggler"} <= alerts
    # Every range window, subquery resolution and offset of the shipped file was scaled.
    assert windows == sum(rule["expr"].count("[") + len(re.findall(r"\boffset\b", rule["expr"]))
                          + len(re.findall(r"\[[^\]:]+:[^\]]+\]", rule["expr"]))
                          for rule, _ in pairs) > 0
    # Prometheus' own checker accepts the copy.
    path = tmp_path / "compressed.rules.yml"
    path.write_text(yaml.safe_dump(compressed, sort_keys=False))
    result = subprocess.run([require_tool("promtool"), "check", "rules", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the webhook receiver and Alertmanager --------------------------------------------------


@dataclass
class Notification:
    """One webhook POST from Alertmanager."""

    arrived: float  # time.monotonic()
    payload: dict[str, Any]
    probe: Any
    """What ``Receiver.probe`` returned the moment the POST arrived."""


class Receiver:
    """A webhook receiver on 127.0.0.1 that keeps every notification Alertmanager POSTs."""

    def __init__(self, probe: Callable[[], Any]) -> None:
        self.probe = probe
        self.notifications: list[Notification] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                arrived = time.monotonic()
                state = receiver.probe()
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver._lock:
                    receiver.notifications.append(Notification(arrived, json.loads(body), state))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    def firing(self, alertname: str) -> list[tuple[Notification, dict[str, Any]]]:
        """Every firing alert called ``alertname`` received so far, with its notification."""
        with self._lock:
            return [(n, alert) for n in self.notifications for alert in n.payload["alerts"]
                    if alert["status"] == "firing" and alert["labels"]["alertname"] == alertname]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class AlertmanagerProcess:
    """A real Alertmanager on 127.0.0.1, clustering off."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def stop(self) -> None:
        terminate(self.process)


def start_alertmanager(tmp_path: Path, webhook_url: str) -> AlertmanagerProcess:
    """Alertmanager routing every alert to ``webhook_url``, grouped by alert and run as the
    shipped config does, but notifying within a second."""
    binary = require_tool("prometheus-alertmanager")
    port = free_port()
    config = {
        "route": {"receiver": "webhook", "group_by": ["alertname", "run"], "group_wait": "1s",
                  "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "webhook",
                       "webhook_configs": [{"url": webhook_url, "send_resolved": False}]}],
    }
    config_path = tmp_path / "alertmanager.yml"
    config_path.write_text(json.dumps(config))  # JSON is valid YAML
    log_path = tmp_path / "alertmanager.log"
    process = launch_service(
        "alertmanager",
        [binary, f"--config.file={config_path}", f"--storage.path={tmp_path / 'am-data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        log_path, f"http://127.0.0.1:{port}/-/ready")
    return AlertmanagerProcess(process, port, log_path)


# --- the demo nodes ---------------------------------------------------------------------------


@dataclass
class DemoNode:
    """What `gpumon demo` runs: an agent on simulated GPUs and a job reporting to it."""

    agent: Agent
    job: SimulatedJob

    @classmethod
    def start(cls, tmp_path: Path, name: str, schedule: str, run: str, *, rank_offset: int = 0,
              world: int = 2, ranks: int = 2) -> DemoNode:
        source = SimulatedSource(2)
        agent = Agent(AgentConfig(address="127.0.0.1", port=0, simulate=2, interval=INTERVAL_S,
                                  socket=str(tmp_path / f"{name}.sock"), node_name=f"{name}-node"),
                      gpu_source=source)
        job = SimulatedJob(source, parse_schedule(schedule, name), ranks=ranks,
                           socket_path=agent.config.socket, run=run, loop=False,
                           rank_offset=rank_offset, world=world)
        agent.start()
        return cls(agent, job)

    @property
    def target(self) -> str:
        """host:port for Prometheus; also the ``instance`` label of its series."""
        return f"127.0.0.1:{self.agent.port}"

    def stop(self) -> None:
        self.job.stop()
        self.agent.stop()


@dataclass
class LeakState:
    """The leak node at one moment: each rank's last per-step peak and where the job is."""

    peak_bytes: dict[int, int]
    predicted_s: dict[int, float | None]
    position: tuple[int, float] | None


@dataclass
class Fleet:
    """Every demo node, the Prometheus scraping them, the Alertmanager and the receiver."""

    nodes: dict[str, DemoNode]
    prometheus: PrometheusProcess
    receiver: Receiver
    started: float  # time.monotonic() when the jobs started
    rules: dict[str, Any]

    def wait_firing(self, alertname: str, what: Callable[[list[dict[str, Any]]], bool]
                    ) -> list[tuple[Notification, dict[str, Any]]]:
        """The firing ``alertname`` alerts received once ``what`` holds of their list."""
        deadline = self.started + ALERT_TIMEOUT_S

        def ready() -> list[tuple[Notification, dict[str, Any]]]:
            found = self.receiver.firing(alertname)
            return found if found and what([alert for _, alert in found]) else []

        found: list[tuple[Notification, dict[str, Any]]] = wait_for(
            ready, timeout=max(1.0, deadline - time.monotonic()), interval=0.2,
            what=f"{alertname} at the webhook")
        return found

    def rule(self, alertname: str) -> dict[str, Any]:
        """The shipped rule of ``alertname`` (labels and annotations as the copy has them)."""
        return next(rule for group in self.rules["groups"] for rule in group["rules"]
                    if rule.get("alert") == alertname)


def _leak_state(node: DemoNode) -> LeakState:
    ranks = [r for r in node.agent.snapshot()["ranks"] if r["run"] == "leak"]
    return LeakState(
        peak_bytes={r["rank"]: r["memory_peak_bytes"] for r in ranks},
        predicted_s={r["rank"]: ((r["analysis"] or {}).get("oom") or {}).get("predicted_seconds")
                     for r in ranks},
        position=node.job.position())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("e2e")
    shipped = _shipped_rules()
    rules_path = tmp / "gpumon.compressed.rules.yml"
    rules_path.write_text(yaml.safe_dump(compress_rules(shipped, TIME_SCALE), sort_keys=False))
    nodes: dict[str, DemoNode] = {}
    receiver: Receiver | None = None
    alertmanager: AlertmanagerProcess | None = None
    prometheus: PrometheusProcess | None = None
    try:
        nodes["leak"] = DemoNode.start(tmp, "leak", LEAK, "leak")
        nodes["input"] = DemoNode.start(tmp, "input", INPUT, "input")
        for n, name in enumerate(("straggler-a", "straggler-b", "straggler-c")):
            nodes[name] = DemoNode.start(tmp, name, STRAGGLER, "straggler", rank_offset=2 * n,
                                         world=STRAGGLER_WORLD, ranks=1 if n == 2 else 2)
        leak_node = nodes["leak"]
        receiver = Receiver(lambda: _leak_state(leak_node))
        alertmanager = start_alertmanager(tmp, receiver.url)
        prometheus = start_prometheus(tmp, [node.target for node in nodes.values()],
                                      scrape_interval="1s", rule_files=[rules_path],
                                      alertmanager=f"127.0.0.1:{alertmanager.port}")
        started = time.monotonic()
        for node in nodes.values():
            node.job.start()
        yield Fleet(nodes, prometheus, receiver, started, shipped)
    finally:
        for node in nodes.values():
            node.stop()
        if prometheus is not None:
            prometheus.stop()
        if alertmanager is not None:
            alertmanager.stop()
        if receiver is not None:
            receiver.stop()


def _ranks(alerts: list[dict[str, Any]], run: str) -> set[str]:
    return {a["labels"]["rank"] for a in alerts if a["labels"].get("run") == run}


def _check_labels_and_annotations(fleet: Fleet, alert: dict[str, Any], node: DemoNode) -> None:
    """The alert carries the rule's labels and annotations, rendered for the rank it is about."""
    rule = fleet.rule(alert["labels"]["alertname"])
    labels, annotations = alert["labels"], alert["annotations"]
    assert labels["severity"] == rule["labels"]["severity"]
    assert labels["job"] == "gpumon" and labels["instance"] == node.target
    assert {"alertname", "severity", "job", "instance", "run", "rank"} <= set(labels)
    assert annotations["summary"] == rule["annotations"]["summary"]
    assert annotations["runbook_url"] == rule["annotations"]["runbook_url"]
    description = annotations["description"]
    assert "{{" not in description and "<no value>" not in description, description
    assert (f"Rank {labels['rank']} of run {labels['run']} on {node.target}"
            in " ".join(description.split())), description


@pytest.mark.slow
def test_a_memory_leak_is_predicted_before_memory_runs_out(fleet: Fleet) -> None:
    leak = fleet.nodes["leak"]
    found = fleet.wait_firing("GpumonOOMPredicted", lambda alerts: bool(_ranks(alerts, "leak")))
    first, alert = min(found, key=lambda pair: pair[0].arrived)
    state: LeakState = first.probe
    capacity = leak.job.source.model.memory_total_bytes
    since_leak_s = first.arrived - fleet.started - WARMUP_S
    print(f"GpumonOOMPredicted for leak ranks {sorted(_ranks([a for _, a in found], 'leak'))} "
          f"arrived {since_leak_s:.1f} s into the {LEAK_S} s leak; peaks then "
          f"{ {r: f'{b / capacity:.1%}' for r, b in state.peak_bytes.items()} } of capacity, "
          f"predicted OOM in { {r: round(s or 0) for r, s in state.predicted_s.items()} } s")
    # Only the leaking run, and its labels and annotations as the rule says.
    assert {a["labels"]["run"] for _, a in found} == {"leak"}
    _check_labels_and_annotations(fleet, alert, leak)
    assert "is predicted to run out of GPU memory in" in alert["annotations"]["description"]
    # It arrived while the leak was still growing, before capacity: with time left to act.
    assert state.position is not None, "the leak phase was over before the alert arrived"
    assert leak.job.schedule.phase(state.position[0]).kind is PhaseKind.LEAK
    assert state.peak_bytes and all(b < capacity for b in state.peak_bytes.values()), state
    assert all(s is not None and s > 0 for s in state.predicted_s.values()), state
    # It took the leak: not before the leak began and then the (compressed) `for:` passed.
    hold_s = duration_s(fleet.rule("GpumonOOMPredicted")["for"]) / TIME_SCALE
    assert since_leak_s > hold_s


@pytest.mark.slow
def test_an_input_bound_run_fires_input_bound_for_its_ranks(fleet: Fleet) -> None:
    found = fleet.wait_firing("GpumonInputBound",
                              lambda alerts: _ranks(alerts, "input") == {"0", "1"})
    alerts = [a for _, a in found]
    print("GpumonInputBound arrived for input ranks 0, 1 after "
          f"{max(n.arrived for n, _ in found) - fleet.started:.1f} s")
    assert {a["labels"]["run"] for a in alerts} == {"input"}
    for alert in alerts:
        _check_labels_and_annotations(fleet, alert, fleet.nodes["input"])
        assert alert["labels"]["phase"] == "data"


@pytest.mark.slow
def test_a_straggler_on_one_of_three_nodes_fires_for_that_rank_only(fleet: Fleet) -> None:
    found = fleet.wait_firing("GpumonRankStraggler", lambda alerts: bool(_ranks(alerts, "straggler")))
    print(f"GpumonRankStraggler arrived for rank {STRAGGLER_RANK} after "
          f"{min(n.arrived for n, _ in found) - fleet.started:.1f} s")
    slow_node = fleet.nodes["straggler-c"]  # rank 4 alone
    # The run-wide score counted all five ranks, over the three nodes, and scored each node's
    # slowest rank against the other four.
    counted = fleet.prometheus.query('run:gpumon_step_own_seconds:count1m{run="straggler"}')
    assert [float(r["value"][1]) for r in counted] == [STRAGGLER_WORLD], counted
    scored = fleet.prometheus.query('run_rank:gpumon_rank_straggler_score:ratio1m{run="straggler"}')
    scores = {r["metric"]["rank"]: float(r["value"][1]) for r in scored}
    assert len({r["metric"]["instance"] for r in scored}) == len(scored) == 3, scored
    assert str(STRAGGLER_RANK) in scores, scores
    # No agent found it: those that could compare saw ranks waiting alike; rank 4 had no peer.
    local = {r["metric"]["rank"]: float(r["value"][1]) for r in
             fleet.prometheus.query('gpumon_rank_straggler_score{run="straggler"}')}
    assert set(local) == {"0", "1", "2", "3"} and min(local.values()) > 0.75, local
    assert not fleet.prometheus.query('gpumon_step_flag{run="straggler",flag="straggler"} == 1')
    # Nothing else fired, and no other rank of any run is even pending.
    alerts = [a for _, a in fleet.receiver.firing("GpumonRankStraggler")]
    assert {(a["labels"]["run"], a["labels"]["rank"]) for a in alerts} == {
        ("straggler", str(STRAGGLER_RANK))}, alerts
    active = fleet.prometheus.query('ALERTS{alertname="GpumonRankStraggler"}')
    assert {(r["metric"]["run"], r["metric"]["rank"]) for r in active} == {
        ("straggler", str(STRAGGLER_RANK))}, active
    for alert in alerts:
        _check_labels_and_annotations(fleet, alert, slow_node)
    assert scores[str(STRAGGLER_RANK)] < 0.75 < min(s for r, s in scores.items()
                                                    if r != str(STRAGGLER_RANK))


@pytest.mark.slow
def test_the_notification_says_whose_rank_it_is(fleet: Fleet) -> None:
    """The straggler's notification names its node (the agent's node name) and its user (the
    uid of the process that sent its steps, this test's own, as the kernel gave it)."""
    found = fleet.wait_firing("GpumonRankStraggler", lambda alerts: bool(_ranks(alerts, "straggler")))
    description = " ".join(found[0][1]["annotations"]["description"].split())
    assert f"Whose: node straggler-c-node, user {user_name(os.getuid())}." in description, description
