"""The sharded pipeline of deploy/fleet/ for real: four agents (four "nodes"), two shards — a
Prometheus server, and a vmagent with a vmalert beside it — each evaluating the shard's rules
(per-rank recording rules, their per-node reductions, the node-level alerts) and
remote-writing to one VictoriaMetrics, the central vmalert evaluating the run-level rules over
those reductions and every alert, one Alertmanager behind both; all Debian's binaries, on
127.0.0.1. The rule files are deploy/fleet/rules/, generated from alerts/ as shipped.

A real 4-rank gloo DDP job, launched as two "nodes" (``torch.distributed.run --nnodes 2
--nproc-per-node 2``, one launcher each), sends each rank to a different agent — ranks 0 and 1
through shard A, 2 and 3 through shard B — and rank 3 sleeps in every forward, so its peers
wait for it in each all-reduce. No agent and no shard holds more than two of the run's ranks:
only the centre sees it whole. Agent 0 runs on the fake NVML with an XID 79, the node-level
alert both the shard and the centre raise.

The second node's clock runs ``SKEW_S`` (2 s) ahead: its launcher, its ranks and its two
agents run under libfaketime. The straggler score must not move for it (every rank is still
scored as the job's own timings say, and nothing is dropped as skewed).

Durations: the rules are the shipped ones (the straggler chain on ``[1m]`` windows, the rest
on ``[5m]``), evaluated every second; the straggler alert is read from vmalert's API, pending or
firing. The windows are read within a minute of the job's end.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpumon.testing import AgentProcess, agent_env, free_port, start_agent, wait_for
from gpumon.testing.metrics import series
from gpumon.testing.pipeline import (
    Service,
    start_alertmanager,
    start_prometheus_shard,
    start_victoria_metrics,
    start_vmagent_shard,
    start_vmalert,
)
from tests.e2e.distributed import JOBS
from tests.e2e.test_dashboards import _label_values, _load, _panels, _substitute
from tests.helpers import ROOT
from tests.testing.fakenvml_fixtures import SCENARIOS, Scenario, fake_nvml_lib  # noqa: F401

pytestmark = pytest.mark.waits

FLEET = ROOT / "deploy" / "fleet"
SHARD_RULES = FLEET / "rules" / "gpumon-shard.rules.yml"
CENTRAL_RULES = FLEET / "rules" / "gpumon-central.rules.yml"
FLEET_BOARD = ROOT / "dashboards" / "gpumon-fleet.json"
RUN = "fleet-ddp"
SLOW_RANK = 3
SLOW_MS = 120.0
"""Rank 3's sleep in every forward: long beside the all-reduce of the small model (~6 ms on
two loaded cores), so that its own exposed share, the run's least, stays well under
GpumonCommunicationBound's 0.15 (with 60 ms it read 0.13)."""
STEPS = 150
SKEW_S = 2.0
"""How far the second node's clock (agents 2 and 3, ranks 2 and 3) runs ahead."""
INTERVAL = "1s"  # scrapes and rule evaluations
SHARD_OF_RANK = {0: "a", 1: "a", 2: "b", 3: "b"}
ALLOWED_EMPTY = {
    "MFU by run": "the DDP job reports no FLOPs",
    "Ranks by OOM risk": "a job on CPU reports no GPU memory, so no rank has an OOM risk",
}


@dataclass
class Pipeline:
    agents: list[AgentProcess]
    store: Service
    shard_a: Service
    shard_b: Service
    shard_b_rules: Service
    vmalert: Service
    alertmanager: Service
    summaries: dict[int, dict[str, Any]]

    def query(self, promql: str) -> list[dict[str, Any]]:
        return self.store.query(promql)

    def by_rank(self, promql: str) -> dict[int, tuple[float, dict[str, str]]]:
        return {int(r["metric"]["rank"]): (float(r["value"][1]), r["metric"])
                for r in self.query(promql)}

    def alerts(self, service: Service) -> list[dict[str, Any]]:
        data = service.get_json("/api/v1/alerts")
        return list(data["data"]["alerts"])


def _compose_flags(service: str) -> list[str]:
    compose = yaml.safe_load((FLEET / "compose" / "docker-compose.yml").read_text())
    return list(compose["services"][service]["command"])


def skewed(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a process of the second node, whose clock runs ``SKEW_S`` ahead (the wall
    clock only: a node's monotonic clock is its own anyway)."""
    import libfaketime

    library = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    assert library.is_file(), library
    return {**env, "LD_PRELOAD": str(library), "FAKETIME": f"+{SKEW_S:g}s",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}


def _run_job(agents: list[AgentProcess], out: Path) -> None:
    env = {**os.environ, "GPUMON_RUN": RUN, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("GPUMON_SOCKET", None)
    env.pop("GPUMON_PURE_PYTHON", None)
    sockets = ",".join(str(agent.socket_path) for agent in agents)
    port = str(free_port())
    nodes = []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node-rank", str(node), "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", port,
                   str(JOBS / "rank_socket.py"), "--sockets", sockets, "--out", str(out),
                   "--model", "small", "--steps", str(STEPS), "--slow-rank", str(SLOW_RANK),
                   "--slow-forward-ms", str(SLOW_MS)]
        nodes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=skewed(env) if node else env, cwd=ROOT))
    for node, launcher in enumerate(nodes):
        output, _ = launcher.communicate(timeout=180)
        assert launcher.returncode == 0, f"node {node} failed:\n{output[-6000:]}"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, fake_nvml_lib: Path  # noqa: F811
             ) -> Iterator[Pipeline]:
    tmp = tmp_path_factory.mktemp("fleet")
    services: list[Service] = []
    agents: list[AgentProcess] = []
    try:
        # The XID is written into the scenario once the agent listens for it: one due before
        # the agent registered (a slow start) would be lost, as with a real driver.
        scenario = Scenario.load(SCENARIOS / "xid79.scn")
        xids = list(scenario.gpu(1).xids)
        scenario.gpu(1).xids.clear()
        scenario_path = tmp / "xid.scn"
        scenario.dump(scenario_path)
        xid_env = agent_env(fake_nvml_lib.parent, scenario_path)
        agents.append(start_agent(tmp, "--interval", "1", env=xid_env, wait_ready=False))
        agents.append(start_agent(tmp, "--simulate", "2", "--interval", "1", wait_ready=False))
        agents += [start_agent(tmp, "--simulate", "2", "--interval", "1", wait_ready=False,
                               env=skewed(dict(os.environ))) for _ in range(2)]
        for agent in agents:
            wait_for(lambda agent=agent: agent.json("/readyz")[0] == 200, timeout=60,
                     what=f"agent on {agent.port}")
        scenario.gpu(1).xids.extend(xids)
        scenario.dump(scenario_path)
        store = start_victoria_metrics(tmp)
        services.append(store)
        alertmanager = start_alertmanager(tmp)
        services.append(alertmanager)
        shard_a = start_prometheus_shard(
            tmp, "shard-a", yaml.safe_load((FLEET / "compose" / "shard-a.yml").read_text()),
            [f"127.0.0.1:{a.port}" for a in agents[:2]], store, [SHARD_RULES], alertmanager,
            INTERVAL)
        services.append(shard_a)
        shard_b = start_vmagent_shard(
            tmp, "shard-b", yaml.safe_load((FLEET / "compose" / "shard-b.yml").read_text()),
            [f"127.0.0.1:{a.port}" for a in agents[2:]], store, INTERVAL)
        services.append(shard_b)
        shard_b_rules = start_vmalert(tmp, _compose_flags("shard-b-rules"), [SHARD_RULES], store,
                                      alertmanager, INTERVAL, name="shard-b-rules")
        services.append(shard_b_rules)
        vmalert = start_vmalert(tmp, _compose_flags("vmalert"), [CENTRAL_RULES], store,
                                alertmanager, INTERVAL)
        services.append(vmalert)
        out = tmp / "job"
        _run_job(agents, out)
        summaries = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}
        yield Pipeline(agents, store, shard_a, shard_b, shard_b_rules, vmalert, alertmanager,
                       summaries)
    finally:
        for service in reversed(services):
            service.stop()
        for agent in agents:
            agent.stop()


def _median_step_s(pipeline: Pipeline, rank: int) -> float:
    return statistics.median(pipeline.summaries[rank]["wall_s"])


@pytest.mark.slow
def test_the_central_straggler_score_sees_the_run_whole(pipeline: Pipeline) -> None:
    query = f'run_rank:gpumon_rank_straggler_score:ratio1m{{run="{RUN}"}}'
    wait_for(lambda: len(pipeline.query(query)) == 4, timeout=60, what="a score for every rank")
    scores = pipeline.by_rank(query)
    print({rank: round(value, 2) for rank, (value, _) in scores.items()})
    # Every rank (each the only one of its node), each through the shard that scraped its agent
    # and reduced its node's ranks; the centre counted all four.
    assert {rank: labels["shard"] for rank, (_, labels) in scores.items()} == SHARD_OF_RANK
    counted = pipeline.query(f'run:gpumon_step_own_seconds:count1m{{run="{RUN}"}}')
    assert [float(r["value"][1]) for r in counted] == [4.0]
    for shard in ("a", "b"):
        reduced = pipeline.query(f'run_node:gpumon_step_own_seconds:sum1m{{run="{RUN}",shard="{shard}"}}')
        assert len(reduced) == 2, (shard, reduced)
    assert scores[SLOW_RANK][0] < 0.75 < min(v for r, (v, _) in scores.items() if r != SLOW_RANK)
    # Its extra own work per step is the sleep the job added, as a share of the step the job
    # timed itself.
    extra = pipeline.by_rank(f'run_rank:gpumon_step_straggler_extra_share:ratio1m{{run="{RUN}"}}')
    truth = SLOW_MS / 1e3 / _median_step_s(pipeline, SLOW_RANK)
    print(f"extra share {extra[SLOW_RANK][0]:.3f}, truth {truth:.3f}")
    assert extra[SLOW_RANK][0] == pytest.approx(truth, abs=0.15)
    # The run's mean step time, over its four ranks on two shards.
    run_mean = pipeline.query(f'run:gpumon_step_duration_seconds:mean5m{{run="{RUN}"}}')
    (mean,) = [float(r["value"][1]) for r in run_mean]
    job_mean = statistics.mean(_median_step_s(pipeline, r) for r in range(4))
    assert mean == pytest.approx(job_mean, rel=0.3), (mean, job_mean)


@pytest.mark.slow
def test_a_node_clock_two_seconds_ahead_moves_nothing(pipeline: Pipeline) -> None:
    """The second node's clock was 2 s ahead (the last steps of its ranks, which ended with
    their peers' in the same all-reduce, read 2 s later), yet no step was dropped as skewed
    and the scores above read as the job's own timings say: every rule reads rates of
    counters on the scraper's clock, never a node's."""
    last, dropped = {}, {}
    for index, agent in enumerate(pipeline.agents):
        metrics = agent.metrics()
        for labels, value in series(metrics, "gpumon_step_last_timestamp_seconds", run=RUN):
            last[int(labels["rank"])] = value
        dropped[index] = {labels["reason"]: v for labels, v in series(metrics, "gpumon_ingest_dropped_total")}
        steps = {int(labels["rank"]): v for labels, v in series(metrics, "gpumon_steps_total", run=RUN)}
        assert all(v == STEPS for v in steps.values()), (index, steps)
    ahead = statistics.mean([last[2], last[3]]) - statistics.mean([last[0], last[1]])
    print(f"the second node's last steps read {ahead:+.2f} s from the first's; dropped {dropped}")
    assert ahead == pytest.approx(SKEW_S, abs=0.5)
    assert all(not reasons.get("clock_skew") for reasons in dropped.values()), dropped


@pytest.mark.slow
def test_the_straggler_alert_is_pending_for_the_slow_rank_alone(pipeline: Pipeline) -> None:
    def straggler_alerts() -> list[dict[str, Any]]:
        return [a for a in pipeline.alerts(pipeline.vmalert)
                if a["labels"]["alertname"] == "GpumonRankStraggler"]

    found = wait_for(straggler_alerts, timeout=60, what="GpumonRankStraggler in vmalert")
    time.sleep(3)  # a few more evaluations: nothing else joins it
    found = straggler_alerts()
    assert [(a["labels"]["run"], a["labels"]["rank"]) for a in found] == [(RUN, str(SLOW_RANK))]
    (alert,) = found
    assert alert["state"] in ("pending", "firing")
    assert alert["labels"]["shard"] == SHARD_OF_RANK[SLOW_RANK]
    assert alert["labels"]["severity"] == "warning"
    # Its state is in the store too, where the dashboards read ALERTS.
    stored = wait_for(lambda: pipeline.query('ALERTS{alertname="GpumonRankStraggler"}'),
                      timeout=15, what="ALERTS in the store")
    assert {(r["metric"]["run"], r["metric"]["rank"]) for r in stored} == {(RUN, str(SLOW_RANK))}


@pytest.mark.slow
def test_the_communication_rules_see_the_peers_wait(pipeline: Pipeline) -> None:
    shares = pipeline.by_rank(f'run_rank:gpumon_comm_exposed_seconds:ratio_rate5m{{run="{RUN}"}}')
    print({rank: round(value, 3) for rank, (value, _) in shares.items()})
    assert set(shares) == {0, 1, 2, 3}
    peers = [shares[r][0] for r in range(3)]
    # The peers wait for the sleeping rank in every all-reduce: about the sleep per step.
    truth = SLOW_MS / 1e3 / statistics.mean(_median_step_s(pipeline, r) for r in range(3))
    assert min(peers) > shares[SLOW_RANK][0] + 0.15
    assert statistics.mean(peers) == pytest.approx(truth, abs=0.2), (peers, truth)
    # The run's least-blocked rank is the straggler, which waits for nobody: the collectives
    # themselves are cheap, and GpumonCommunicationBound holds for no rank.
    least = pipeline.query(f'min by (run) (run_rank:gpumon_comm_exposed_seconds:ratio_rate5m{{run="{RUN}"}})')
    assert float(least[0]["value"][1]) == pytest.approx(shares[SLOW_RANK][0])
    assert not [a for a in pipeline.alerts(pipeline.vmalert)
                if a["labels"]["alertname"] == "GpumonCommunicationBound"]


@pytest.mark.slow
def test_a_node_alert_from_shard_and_centre_is_one_alert(pipeline: Pipeline) -> None:
    def firing(service: Service) -> list[dict[str, Any]]:
        return [a for a in pipeline.alerts(service) if a["labels"]["alertname"] == "GpumonXidError"
                and a["state"] == "firing"]

    for service in (pipeline.shard_a, pipeline.vmalert):
        wait_for(lambda service=service: firing(service), timeout=30,
                 what=f"GpumonXidError in {service.name}")

    def held() -> list[dict[str, Any]]:
        alerts = pipeline.alertmanager.get_json("/api/v2/alerts")
        return [a for a in alerts if a["labels"]["alertname"] == "GpumonXidError"]

    (alert,) = wait_for(held, timeout=30, what="GpumonXidError in Alertmanager")
    labels = alert["labels"]
    assert labels["xid"] == "79" and labels["severity"] == "critical"
    assert labels["instance"] == f"127.0.0.1:{pipeline.agents[0].port}"
    assert labels["shard"] == "a" and labels["cluster"]


@pytest.mark.slow
def test_the_fleet_dashboard_sees_every_node_and_the_run(pipeline: Pipeline) -> None:
    board = _load(FLEET_BOARD)
    variables = board["templating"]["list"]
    (job_var,) = [v for v in variables if v["name"] == "job"]
    assert _label_values(pipeline.store, job_var["definition"], {}) == ["gpumon"]
    values = {"job": "(gpumon)"}
    empty = []
    for panel in _panels(board):
        if panel["type"] == "row":
            continue
        for target in panel["targets"]:
            result = pipeline.query(_substitute(target["expr"], values))
            if not result:
                empty.append(panel["title"])
    assert sorted(set(empty)) == sorted(ALLOWED_EMPTY), empty
    # Four nodes through two shards, their eight GPUs, and the run's step time, whole.
    def value(expr: str) -> float:
        (sample,) = pipeline.query(_substitute(expr, values))
        return float(sample["value"][1])

    targets = {panel["title"]: panel["targets"] for panel in _panels(board) if panel["type"] != "row"}
    assert value(targets["Nodes"][0]["expr"]) == 4
    assert value(targets["GPUs"][0]["expr"]) == 8
    runs = {r["metric"]["run"] for r in pipeline.query(targets["Mean step time by run"][0]["expr"])}
    assert RUN in runs
    shares = pipeline.query(_substitute(targets["Input and communication share by run"][1]["expr"], values))
    (share,) = [float(r["value"][1]) for r in shares if r["metric"]["run"] == RUN]
    exposed = pipeline.by_rank(f'run_rank:gpumon_comm_exposed_seconds:ratio_rate5m{{run="{RUN}"}}')
    assert share == pytest.approx(statistics.mean(v for v, _ in exposed.values()), abs=0.05)
