"""Grafana dashboards: well-formed, in sync with their generator, and every query returns data
from a real Prometheus scraping a real agent fed with a three-rank run and, for the panels of a
job that splits its model, a two-stage pipeline beside it."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import (
    ROOT,
    AgentProcess,
    PrometheusProcess,
    start_agent,
    start_prometheus,
    wait_for,
)

pytestmark = pytest.mark.waits

DASHBOARD_DIR = ROOT / "dashboards"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))
RULE_FILES = sorted((ROOT / "alerts").glob("*.rules.yml"))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GIB = 1024**3

# Panels that cannot have data on a simulated node, and why. Kept short on purpose: anything
# else must return data, and an entry here must really be empty (a stale entry fails).
ALLOWED_EMPTY = {
    ("gpumon-node.json", "GPU memory by process"):
        "simulated GPUs have no process list (tests/collectors/test_nvml_agent.py covers the metric)",
    ("gpumon-node.json", "Whose GPUs"):
        "simulated GPUs have no process list (tests/agent/test_owners.py covers the metric)",
    ("gpumon-training.json", "Where stalled ranks are"):
        "a stepping run has no stalled rank (tests/e2e/test_stalled_runs.py covers the metrics)",
    ("gpumon-node.json", "XID errors by GPU"):
        "simulated GPUs raise no XID; the 'XID errors' stat shows 0 through `or vector(0)`",
}
# Variables that cannot offer a value here: the fed run is neither in a pod nor in a Slurm job.
# Grafana then sets such a multi-value variable to All, its ``allValue``; so does this test.
ALLOWED_EMPTY_VARIABLES = {
    ("gpumon-training.json", "namespace"): "the feeding process is in no pod (test_cgroup.py)",
    ("gpumon-training.json", "pod"): "the feeding process is in no pod (test_cgroup.py)",
    ("gpumon-training.json", "slurm_job"): "the feeding process is in no Slurm job",
}
# The rows about a job that splits its model: their panels are run against the pipeline fed
# beside the data-parallel run (which has no stage and no bubble to show).
PIPELINE_ROWS = {("gpumon-training.json", "Model parallelism")}
PIPELINE_RUN = "pipe"
# Grafana's built-in interval variables, as a dashboard over the last few minutes sets them.
BUILTINS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboards_generate",
                                                  DASHBOARD_DIR / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def _load(path: Path) -> dict[str, Any]:
    board: dict[str, Any] = json.loads(path.read_text())
    return board


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def _rows(board: dict[str, Any]) -> dict[str, str]:
    """Each panel's title → the title of the row it sits under."""
    under, out = "", {}
    for panel in _panels(board):
        if panel["type"] == "row":
            under = panel["title"]
        else:
            out[panel["title"]] = under
    return out


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{path}.{key}", value
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def test_there_are_three_dashboards() -> None:
    names = {path.name for path in DASHBOARDS}
    assert names == {"gpumon-training.json", "gpumon-node.json", "gpumon-fleet.json"}


def test_dashboards_match_their_generator() -> None:
    generator = _load_generator()
    assert set(generator.DASHBOARDS) == {path.name for path in DASHBOARDS}
    for name, build in generator.DASHBOARDS.items():
        assert (DASHBOARD_DIR / name).read_text() == generator.render(build), (
            f"dashboards/{name} is stale: run python dashboards/generate.py")


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    board = _load(path)
    assert board["schemaVersion"] >= 38
    assert board["uid"] and board["title"] and "gpumon" in board["tags"]
    variables = board["templating"]["list"]
    assert variables[0] == {**variables[0], "name": "datasource", "type": "datasource",
                            "query": "prometheus"}
    for variable in variables[1:]:
        assert variable["type"] == "query" and variable["datasource"] == DATASOURCE
        assert _LABEL_VALUES.match(variable["definition"]), variable["definition"]
    panels = _panels(board)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    titles = [panel["title"] for panel in panels if panel["type"] != "row"]
    assert len(titles) == len(set(titles)), f"duplicate panel titles in {path.name}"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["description"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
    # No hard-coded data source anywhere: every uid but the dashboard's own is the variable.
    for where, value in _walk(board):
        if where.endswith(".uid") and where != ".uid":
            assert value == "${datasource}", f"hard-coded uid at {where} in {path.name}"


# --- live: a real agent, a real Prometheus ---------------------------------------------------


@dataclass
class Live:
    """The agent, the Prometheus scraping it, and the run the feeder reports."""

    agent: AgentProcess
    prometheus: PrometheusProcess
    run: str


PIPELINE_STAGES = {  # stage → (forward, backward, exposed wait, of which the bubble), seconds
    0: (0.01, 0.01, 0.20, 0.18),  # own work 0.1 s of each 0.3 s step: waits for stage 1
    1: (0.05, 0.10, 0.06, 0.05),  # own work 0.24 s
}


def _pipeline_step(rank: int, step: int, t_start: float, gpu: str) -> dict[str, Any]:
    """A step of the pipeline run: rank r is stage r of two, data-parallel replica 0; as
    much data wait as the data-parallel run's (0.07 s), its own work and its wait to send and
    receive in forward and backward."""
    forward, backward, exposed, bubble = PIPELINE_STAGES[rank]
    return {"v": 1, "kind": "step", "run": PIPELINE_RUN, "rank": rank, "world": 2,
            "local_rank": rank, "step": step, "t_start": t_start, "duration": 0.3, "gpu": gpu,
            "phases": {"data": 0.07, "forward": forward, "backward": backward + exposed,
                       "optimizer": 0.3 - 0.07 - forward - backward - exposed},
            "comm": {"exposed": exposed, "busy": exposed + 0.01, "bubble": bubble,
                     "ops": {"send": [4, 8 * 1024**2, 0.01], "recv": [4, 8 * 1024**2, exposed]}},
            "samples": 8, "tokens": 1024}


def _feed(agent: AgentProcess, gpus: list[str], stop: threading.Event) -> None:
    """A synchronous 3-rank run on two GPUs, watched as DDP is: 0.3 s steps, a quarter waiting
    for data, rank 2 computing 0.1 s more than its peers, who wait for it in the all-reduce
    (inside their backward phase); per-step peaks growing towards capacity (so an OOM is
    predicted), and a memory breakdown on every fifth step whose ``other`` grows with the
    peak. Beside it a pipeline of two stages (``_pipeline_step``), each rank's layout in its
    hello."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.sendto(b"this is not json", str(agent.socket_path))  # one counted drop
    for rank in range(3):  # as watch(engine) says hello for a DeepSpeed engine at ZeRO-1
        hello = {"v": 1, "kind": "hello", "run": "llm", "rank": rank, "world": 3,
                 "framework": "deepspeed", "zero_stage": 1}
        sock.sendto(json.dumps(hello).encode(), str(agent.socket_path))
    for rank in PIPELINE_STAGES:  # as a pipeline stage's hook says hello once it knows its place
        hello = {"v": 1, "kind": "hello", "run": PIPELINE_RUN, "rank": rank, "world": 2,
                 "parallel": {"dp": 0, "pp": rank, "source": "pipeline"}}
        sock.sendto(json.dumps(hello).encode(), str(agent.socket_path))
    step = 0
    while not stop.is_set():
        t_start = time.time() - 0.3
        for rank in PIPELINE_STAGES:
            sock.sendto(json.dumps(_pipeline_step(rank, step, t_start, gpus[rank % len(gpus)]))
                        .encode(), str(agent.socket_path))
        for rank in range(3):
            forward, backward = (0.06, 0.13) if rank == 2 else (0.03, 0.06)
            exposed = 0.3 - 0.07 - forward - backward - 0.02  # rank 2: 0.02 s, its peers 0.12 s
            peak = 30 * GIB + step * 64 * 1024**2
            record = {
                "v": 1, "kind": "step", "run": "llm", "rank": rank, "world": 3,
                "local_rank": rank, "step": step, "t_start": t_start, "duration": 0.3,
                "phases": {"data": 0.07, "forward": forward, "backward": backward + exposed,
                           "optimizer": 0.02},
                "comm": {"exposed": exposed, "busy": exposed + 0.04,
                         "ops": {"all_reduce": [4, 64 * 1024**2, exposed + 0.04],
                                 "broadcast": [1, 4096, 0.001],
                                 "all_to_all": [4, 8 * 1024**2, 0.01]}},
                # Two MoE layers over the last steps (watch() of a MoE model): layer 1 skewed,
                # one of its experts idle.
                "moe": {"window": min(step + 1, 50),
                        "layers": {"0": [8, 4096 * 2, 1.2, 0.1, 0], "1": [8, 4096 * 2, 2.6, 0.9, 1]}},
                "samples": 32, "tokens": 4096, "flops": 1e14, "gpu": gpus[rank % len(gpus)],
                "mem": {"allocated": peak - 2 * GIB, "reserved": peak + GIB, "peak": peak,
                        "retries": step // 20, "ooms": 0},
            }
            if step % 5 == 0:  # the sampled breakdown (watch(model, optimizer)); leaking
                record["memb"] = {"parameters": 4 * GIB, "gradients": 4 * GIB,
                                  "optimizer_states": 8 * GIB, "activations": 12 * GIB,
                                  "other": peak - 28 * GIB}
            sock.sendto(json.dumps(record).encode(), str(agent.socket_path))
        step += 1
        stop.wait(0.3)
    sock.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("dashboards")
    agent = start_agent(tmp, "--simulate", "2", "--interval", "0.25")
    stop = threading.Event()
    feeder: threading.Thread | None = None
    prometheus: PrometheusProcess | None = None
    try:
        status, snapshot = agent.json("/api/v1/snapshot")
        assert status == 200
        gpus = [gpu["uuid"] for gpu in snapshot["gpus"]]
        feeder = threading.Thread(target=_feed, args=(agent, gpus, stop), daemon=True)
        feeder.start()
        prometheus = start_prometheus(tmp, [f"127.0.0.1:{agent.port}"], scrape_interval="1s",
                                      rule_files=RULE_FILES)
        yield Live(agent, prometheus, "llm")
    finally:
        stop.set()
        if feeder is not None:
            feeder.join(5)
        if prometheus is not None:
            prometheus.stop()
        agent.stop()


def _label_values(prometheus: PrometheusProcess, definition: str, values: dict[str, str]) -> list[str]:
    match = _LABEL_VALUES.match(definition)
    assert match, definition
    selector, label = _substitute(match["selector"], values), match["label"]
    return sorted({r["metric"][label] for r in prometheus.query(f"group by ({label}) ({selector})")
                   if label in r["metric"]})


def _substitute(expr: str, values: dict[str, str]) -> str:
    mapping = {**BUILTINS, **{f"${name}": value for name, value in values.items()}}
    for name, value in sorted(mapping.items(), key=lambda item: -len(item[0])):
        expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def _variable_choices(prometheus: PrometheusProcess,
                      variables: list[dict[str, Any]]) -> tuple[list[dict[str, str]], list[str]]:
    """Two selections (every multi-value variable at All, then each variable at its first
    value) and the variables whose query offers no value at all."""
    all_values: dict[str, str] = {}
    first_values: dict[str, str] = {}
    empty = []
    for variable in variables[1:]:
        options = _label_values(prometheus, variable["definition"], first_values)
        if not options:
            empty.append(f"variable {variable['name']}: {variable['definition']}")
            if variable["multi"] and variable.get("allValue"):  # Grafana's All, as it sets it
                first_values[variable["name"]] = all_values[variable["name"]] = variable["allValue"]
                continue
            options = ["none"]
        first_values[variable["name"]] = options[0]
        if not variable["multi"]:
            all_values[variable["name"]] = options[0]
        else:  # Grafana's All without an allValue: every listed value, as a regex
            all_values[variable["name"]] = variable.get("allValue") or f"({'|'.join(options)})"
    return [all_values, first_values], empty


def _targets() -> list[tuple[str, str, dict[str, Any]]]:
    return [(path.name, panel["title"], target)
            for path in DASHBOARDS for panel in _panels(_load(path)) if panel["type"] != "row"
            for target in panel["targets"]]


def _empty_queries(live: Live) -> list[str]:
    empty: list[str] = []
    for path in DASHBOARDS:
        board = _load(path)
        choices, empty_variables = _variable_choices(live.prometheus, board["templating"]["list"])
        empty.extend(f"{path.name} / {line}" for line in empty_variables)
        rows = _rows(board)
        for panel in _panels(board):
            if panel["type"] == "row":
                continue
            pipeline = (path.name, rows[panel["title"]]) in PIPELINE_ROWS
            for target in panel["targets"]:
                for values in choices:
                    values = {**values, "run": PIPELINE_RUN} if pipeline else values
                    expr = _substitute(target["expr"], values)
                    if not live.prometheus.query(expr):
                        empty.append(f"{path.name} / {panel['title']} / {target['refId']}: {expr}")
                        break
    return empty


def _allowed(line: str) -> bool:
    return any(line.startswith(f"{board} / {title} /") for board, title in ALLOWED_EMPTY) or any(
        line.startswith(f"{board} / variable {name}:") for board, name in ALLOWED_EMPTY_VARIABLES)


@pytest.mark.slow
def test_every_panel_query_returns_data(live: Live) -> None:
    # Wait until the scrape history is long enough for every rate and recording rule (and the
    # pending alerts) to have data; stop as soon as only the allowed panels are empty.
    deadline = time.monotonic() + 60
    while True:
        empty = _empty_queries(live)
        unexpected = [line for line in empty if not _allowed(line)]
        if not unexpected or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not unexpected, "queries without data:\n" + "\n".join(unexpected)
    for board, title in ALLOWED_EMPTY:
        assert any(line.startswith(f"{board} / {title} /") for line in empty), (
            f"{board} / {title} now has data: drop it from ALLOWED_EMPTY")
    for board, name in ALLOWED_EMPTY_VARIABLES:
        assert any(line.startswith(f"{board} / variable {name}:") for line in empty), (
            f"{board} / variable {name} now has values: drop it from ALLOWED_EMPTY_VARIABLES")
    assert len(_targets()) > 60


@pytest.mark.slow
def test_panel_queries_see_the_fed_run(live: Live) -> None:
    """Spot checks that the data behind the panels is the run the feeder reports."""
    prometheus = live.prometheus
    ranks = wait_for(lambda: prometheus.query('run_rank:gpumon_rank_straggler_score:ratio1m{run="llm"}'),
                     timeout=30, what="straggler scores")
    scores = {r["metric"]["rank"]: float(r["value"][1]) for r in ranks}
    # One node: its slowest rank carries the run-wide score, against all three ranks' sums.
    assert set(scores) == {"2"}
    counted = prometheus.query('run:gpumon_step_own_seconds:count1m{run="llm"}')
    assert [float(r["value"][1]) for r in counted] == [3.0]
    # own work (step less collective wait): rank 2 0.28 s, its peers 0.18 s
    assert scores["2"] == pytest.approx(0.18 / 0.28, abs=0.05)
    # Flagged once its slowness has persisted over 24 steps (7 s of this run).
    causes = wait_for(lambda: prometheus.query('gpumon_rank_straggler_cause{run="llm"} == 1'),
                      timeout=30, what="the straggler's cause")
    assert [(r["metric"]["rank"], r["metric"]["cause"]) for r in causes] == [("2", "compute")]
    exposed = prometheus.query('run_rank:gpumon_comm_exposed_seconds:ratio_rate5m{run="llm"}')
    assert {r["metric"]["rank"]: round(float(r["value"][1]), 2) for r in exposed} == {
        "0": 0.4, "1": 0.4, "2": 0.07}
    share = prometheus.query('run_rank_phase:gpumon_step_phase_share:ratio_rate5m{phase="data"}')
    assert all(0.2 <= float(r["value"][1]) <= 0.27 for r in share), share  # 0.07 / 0.3
    joined = prometheus.query('run_rank:gpumon_gpu_memory_total_bytes{run="llm"}')
    assert {r["metric"]["gpu"] for r in joined} == {"0", "1"}
    assert all(float(r["value"][1]) == 80 * GIB for r in joined)


def _panel_query(title: str, **values: str) -> str:
    """The query of the training dashboard's panel ``title``, its variables set."""
    (panel,) = [p for p in _panels(_load(DASHBOARD_DIR / "gpumon-training.json"))
                if p["title"] == title]
    return _substitute(panel["targets"][0]["expr"], {"rank": ".*", **values})


@pytest.mark.slow
def test_the_model_parallelism_row_names_the_pipelines_slowest_stage(live: Live) -> None:
    """The pipeline's panels show its layout, each stage's own work and bubble, and the stage
    the other waits for: stage 1, 0.24 s of own work a step against stage 0's 0.1 s."""
    prometheus = live.prometheus

    def by(title: str, label: str) -> dict[str, float]:
        return {r["metric"][label]: float(r["value"][1])
                for r in prometheus.query(_panel_query(title, run=PIPELINE_RUN))}

    slowest = wait_for(lambda: by("Pipeline imbalance (slowest stage)", "pp"), timeout=30,
                       what="the pipeline's imbalance")
    assert slowest == {"1": pytest.approx(0.24 / 0.17, abs=0.05)}
    assert by("Own work per pipeline stage", "pp") == {"0": pytest.approx(0.1, abs=0.01),
                                                       "1": pytest.approx(0.24, abs=0.01)}
    assert by("Pipeline bubble per rank", "rank") == {"0": pytest.approx(0.6, abs=0.03),
                                                      "1": pytest.approx(0.05 / 0.3, abs=0.03)}
    layouts = prometheus.query(_panel_query("Layout per rank", run=PIPELINE_RUN))
    assert sorted((r["metric"]["rank"], r["metric"]["pp"], r["metric"]["dp"]) for r in layouts) \
        == [("0", "0", "0"), ("1", "1", "0")]
    # The data-parallel run has no stage: the row is empty for it, and no rank is a stage.
    assert not prometheus.query(_panel_query("Pipeline imbalance (slowest stage)", run="llm"))
