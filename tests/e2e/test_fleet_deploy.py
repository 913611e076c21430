"""deploy/fleet/: the sharded pipeline's files parse, reference each other (mounted files exist,
URLs name services that exist, selectors match labels), the generated files are current, and
promtool, amtool, vmagent and vmalert accept the configurations."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from tests.helpers import ROOT, require_tool

FLEET = ROOT / "deploy" / "fleet"
COMPOSE = FLEET / "compose"
KUBE = FLEET / "kubernetes"
SHARD_RULES = FLEET / "rules" / "gpumon-shard.rules.yml"
CENTRAL_RULES = FLEET / "rules" / "gpumon-central.rules.yml"
RULE_FILE = ROOT / "alerts" / "gpumon.rules.yml"
RECORDED = re.compile(r"\b([a-z_]+):gpumon_[a-z_]+(?::[a-z_0-9]+)?")


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleet_generate", FLEET / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _compose() -> dict[str, Any]:
    compose: dict[str, Any] = _yaml(COMPOSE / "docker-compose.yml")
    return compose


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60)


def _flags(command: list[str]) -> dict[str, str]:
    """``-name=value`` arguments of a VictoriaMetrics command line (last one wins)."""
    return dict(arg.lstrip("-").split("=", 1) if "=" in arg else (arg.lstrip("-"), "")
                for arg in command)


def test_generated_files_are_current() -> None:
    for path, text in _load_generator().outputs().items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} is stale: run python deploy/fleet/generate.py")


def test_shards_evaluate_what_reads_their_own_nodes() -> None:
    shipped = {g["name"]: g for g in _yaml(RULE_FILE)["groups"]}
    shard = _yaml(SHARD_RULES)["groups"]
    assert shard and all(group == shipped[group["name"]] for group in shard)
    # Recording rules: per rank, or reduced per node and run (every output keeps job and
    # instance, so two shards never write the same series); never a run-level `run:` series.
    records = [rule for group in shard for rule in group["rules"] if "record" in rule]
    assert records and all(r["record"].startswith(("run_rank:", "run_rank_phase:", "run_node:",
                                                    "run_node_bottleneck:", "run_node_cause:",
                                                    "run_node_layer:"))
                           for r in records)
    for rule in records:
        for by in re.findall(r"\b(?:sum|count|max|min|topk) by \(([^)]*)\)", rule["expr"]):
            assert {"job", "instance"} <= {x.strip() for x in by.split(",")}, rule["record"]
    alerts = [rule for group in shard for rule in group["rules"] if "alert" in rule]
    assert not [rule["alert"] for rule in alerts if RECORDED.search(rule["expr"])]
    assert {"GpumonAgentDown", "GpumonGpuLost", "GpumonXidError"} <= {r["alert"] for r in alerts}


def test_the_centre_reads_one_series_per_node_not_per_rank() -> None:
    """The central run-level rules read only the shards' per-node reductions and each other, so
    their work grows with nodes, not ranks; every alert is central too."""
    shipped = {g["name"]: g for g in _yaml(RULE_FILE)["groups"]}
    central = _yaml(CENTRAL_RULES)["groups"]
    assert central and all(group == shipped[group["name"]] for group in central)
    names = {g["name"] for g in central} | {g["name"] for g in _yaml(SHARD_RULES)["groups"]}
    assert names == set(shipped)
    records = [rule for group in central for rule in group["rules"] if "record" in rule]
    outputs = {r["record"] for r in records}
    for rule in records:
        assert not re.search(r"\bgpumon_[a-z_]+", re.sub(RECORDED, "", rule["expr"])), rule["record"]
        for series in (m[0] for m in RECORDED.finditer(rule["expr"])):
            assert series.startswith(("run_node:", "run_node_bottleneck:", "run_node_cause:",
                                                    "run_node_layer:")) \
                or series in outputs, \
                (rule["record"], series)
    alerts = {r["alert"] for g in central for r in g["rules"] if "alert" in r}
    assert {"GpumonRankStraggler", "GpumonCommunicationBound", "GpumonXidError"} <= alerts
    assert "run_rank:gpumon_step_own_seconds:peers_mean1m" in outputs


def test_compose_references_hold() -> None:
    compose = _compose()
    services = compose["services"]
    names = set(services) | {alias for s in services.values()
                             for alias in s.get("networks", {}).get("default", {}).get("aliases", [])}
    for name, service in services.items():
        assert service.get("profiles"), f"{name} runs in no profile"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), f"{name}: {source} does not exist"
        for arg in service.get("command", []):
            for url in re.findall(r"https?://[^\s,]+", str(arg)):
                assert urlparse(url).hostname in names, f"{name}: {url}"
    # The store answers as `central` in both profiles, and only once in each.
    for profile in ("single", "cluster"):
        central = [n for n, s in services.items() if profile in s["profiles"]
                   and "central" in s.get("networks", {}).get("default", {}).get("aliases", [])]
        assert len(central) == 1, (profile, central)
        assert all(profile in s["profiles"] for n, s in services.items()
                   if n.startswith(("gpumon-", "shard-", "vmalert", "alertmanager", "grafana")))
    # vmalert: the central rules, against the store, to Alertmanager.
    vmalert = services["vmalert"]
    flags = _flags(vmalert["command"])
    mounts = dict(v.split(":")[:2] for v in vmalert["volumes"])
    assert (COMPOSE / "../rules").resolve() == CENTRAL_RULES.parent
    assert flags["rule"] == f"{mounts['../rules']}/{CENTRAL_RULES.name}"
    for key in ("datasource.url", "remoteWrite.url", "remoteRead.url"):
        assert urlparse(flags[key]).hostname == "central", key
    assert urlparse(flags["notifier.url"]).hostname == "alertmanager"
    assert "disableAlertgroupLabel" in flags
    # Shard B's ruler: the shard's rules over shard B's series only, labelled as shard B.
    rules_b = services["shard-b-rules"]
    flags_b = _flags(rules_b["command"])
    mounts_b = dict(v.split(":")[:2] for v in rules_b["volumes"])
    assert flags_b["rule"] == f"{mounts_b['../rules']}/{SHARD_RULES.name}"
    labels_b = _yaml(COMPOSE / "shard-b.yml")["global"]["external_labels"]
    source = urlparse(flags_b["datasource.url"])
    assert source.hostname == "central" and source.query == f"extra_label=shard={labels_b['shard']}"
    given = [a.split("=", 1)[1] for a in rules_b["command"] if a.startswith("-external.label=")]
    assert sorted(given) == sorted(f"{k}={v}" for k, v in labels_b.items())
    assert "disableAlertgroupLabel" in flags_b
    # Shard B's vmagent writes to the store; Grafana reads it.
    assert urlparse(_flags(services["shard-b"]["command"])["remoteWrite.url"]).hostname == "central"
    (datasource,) = _yaml(COMPOSE / "grafana" / "datasources.yml")["datasources"]
    assert urlparse(datasource["url"]).hostname == "central" and datasource["isDefault"]


def test_compose_shards() -> None:
    services = _compose()["services"]
    a, b = _yaml(COMPOSE / "shard-a.yml"), _yaml(COMPOSE / "shard-b.yml")
    labels = [a["global"]["external_labels"], b["global"]["external_labels"]]
    assert all({"cluster", "shard"} <= set(x) for x in labels) and labels[0] != labels[1]
    # Shard A evaluates the shard's rules (the generated file, mounted) and sends to the
    # same Alertmanager as the centre; both write to the store.
    mounts = dict(v.split(":")[:2] for v in services["shard-a"]["volumes"])
    assert (COMPOSE / "../rules").resolve() == SHARD_RULES.parent
    assert a["rule_files"] == [f"{mounts['../rules']}/{SHARD_RULES.name}"]
    (remote,) = a["remote_write"]
    assert urlparse(remote["url"]).hostname == "central"
    (manager,) = a["alerting"]["alertmanagers"]
    assert manager["static_configs"][0]["targets"] == ["alertmanager:9093"]
    # Every node is scraped by exactly one shard, as job gpumon (what GpumonAgentDown watches).
    nodes = {n for n in services if n.startswith("gpumon-")}
    scraped = [t.split(":")[0] for config in (a, b) for job in config["scrape_configs"]
               for sc in job["static_configs"] for t in sc["targets"]]
    assert sorted(scraped) == sorted(nodes)
    assert {job["job_name"] for c in (a, b) for job in c["scrape_configs"]} == {"gpumon"}


def test_shard_a_passes_promtool(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    config = _yaml(COMPOSE / "shard-a.yml")
    config["rule_files"] = [str(SHARD_RULES)]  # the file the container path mounts
    path = tmp_path / "shard-a.yml"
    path.write_text(yaml.safe_dump(config))
    result = _run(promtool, "check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    rules = sum(len(group["rules"]) for group in _yaml(SHARD_RULES)["groups"])
    assert f"SUCCESS: {rules} rules found" in result.stdout, result.stdout


def test_shard_b_passes_vmagent() -> None:
    result = _run(require_tool("vmagent"), f"-promscrape.config={COMPOSE / 'shard-b.yml'}",
                  "-promscrape.config.dryRun", "-loggerLevel=ERROR")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", [RULE_FILE, SHARD_RULES, CENTRAL_RULES], ids=lambda p: p.name)
def test_rules_pass_vmalert(path: Path) -> None:
    """vmalert parses every expression (MetricsQL) and template of the rules it loads."""
    result = _run(require_tool("vmalert"), f"-rule={path}", "-dryRun", "-loggerLevel=ERROR")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", [SHARD_RULES, CENTRAL_RULES], ids=lambda p: p.name)
def test_generated_rules_pass_promtool(path: Path) -> None:
    result = _run(require_tool("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_centre_keeps_a_rank_that_moved_shards_one_rank_of_one_run() -> None:
    """The centre's promtool cases (deploy/fleet/tests/): a rank restarted on a node of
    another shard is counted once and scored where it runs, with the same score."""
    tests = sorted((CENTRAL_RULES.parent.parent / "tests").glob("*.test.yml"))
    assert tests
    result = subprocess.run([require_tool("promtool"), "test", "rules", *map(str, tests)],
                            capture_output=True, text=True, timeout=120, cwd=tests[0].parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(tests), result.stdout


def test_vmauth_routes_writes_and_reads() -> None:
    """The cluster's one address routes writes to vminsert and reads to vmselect (tenant 0).
    Structure only: Debian's vmauth (1.79) predates ``unauthorized_user``, which the compose
    form's image (1.102) reads, so no binary here can load it."""
    config = _yaml(COMPOSE / "vmauth-cluster.yml")
    routes = {tuple(m["src_paths"]): m["url_prefix"] for m in config["unauthorized_user"]["url_map"]}
    assert routes[("/api/v1/write",)] == "http://vminsert:8480/insert/0/prometheus/"
    (reads,) = [paths for paths in routes if "/api/v1/query" in paths]
    assert routes[reads] == "http://vmselect:8481/select/0/prometheus/"
    assert {"/api/v1/query_range", "/api/v1/series", "/api/v1/labels"} <= set(reads)
    services = _compose()["services"]
    for prefix in routes.values():
        host = urlparse(prefix)
        assert host.hostname in services and "cluster" in services[str(host.hostname)]["profiles"]
    assert "vmauth-cluster.yml" in " ".join(services["vmauth"]["volumes"])


# --- Kubernetes --------------------------------------------------------------------------


def _objects(directory: Path) -> list[dict[str, Any]]:
    return [doc for path in sorted(directory.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def _find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("part", ["shard", "central"])
def test_kustomizations_list_their_manifests(part: str) -> None:
    kustomization = _yaml(KUBE / part / "kustomization.yaml")
    local = {r for r in kustomization["resources"] if not r.startswith("..")}
    assert local == {p.name for p in (KUBE / part).glob("*.yaml")} - {"kustomization.yaml"}
    for resource in kustomization["resources"]:
        assert (KUBE / part / resource).exists(), resource
    for obj in _objects(KUBE / part):
        assert obj["apiVersion"] and obj["metadata"]["name"], obj
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] in ("gpumon", "gpumon-central"), obj["metadata"]


def test_shard_prometheus() -> None:
    objects = _objects(KUBE / "shard")
    base = [doc for p in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
            for doc in yaml.safe_load_all(p.read_text()) if doc]
    prometheus = _find(objects, "Prometheus", "gpumon-shard")["spec"]
    # It scrapes the agents' ServiceMonitor and loads the shard's rules, not the full set
    # (which the shard's kustomization deletes from the base).
    monitor = _find(base, "ServiceMonitor", "gpumon")
    assert prometheus["serviceMonitorSelector"]["matchLabels"].items() <= \
        monitor["metadata"]["labels"].items()
    node = _find(objects, "PrometheusRule", "gpumon-shard")
    assert prometheus["ruleSelector"]["matchLabels"].items() <= node["metadata"]["labels"].items()
    full = _find(base, "PrometheusRule", "gpumon")
    assert not prometheus["ruleSelector"]["matchLabels"].items() <= full["metadata"]["labels"].items()
    (patch,) = _yaml(KUBE / "shard" / "kustomization.yaml")["patches"]
    deleted = yaml.safe_load(patch["patch"])
    assert deleted["$patch"] == "delete" and deleted["kind"] == "PrometheusRule"
    assert deleted["metadata"] == {"name": full["metadata"]["name"],
                                   "namespace": full["metadata"]["namespace"]}
    assert node["spec"]["groups"] == _yaml(SHARD_RULES)["groups"]
    assert prometheus["externalLabels"]["cluster"]
    assert prometheus["replicaExternalLabelName"] == ""  # HA copies deduplicated centrally
    assert prometheus["serviceAccountName"] == _find(objects, "ServiceAccount",
                                                     prometheus["serviceAccountName"])["metadata"]["name"]
    # Its remote write and Alertmanager are the centre's Services.
    central = _objects(KUBE / "central")
    (remote,) = prometheus["remoteWrite"]
    host = urlparse(remote["url"])
    service, namespace = host.hostname.split(".")[:2]  # type: ignore[union-attr]
    ports = {p["port"] for p in _find(central, "Service", service)["spec"]["ports"]}
    assert namespace == "gpumon-central" and host.port in ports
    (manager,) = prometheus["alerting"]["alertmanagers"]
    am = _find(central, "Service", manager["name"])
    assert manager["namespace"] == am["metadata"]["namespace"]
    assert manager["port"] in {p["name"] for p in am["spec"]["ports"]}


def test_central_services() -> None:
    objects = _objects(KUBE / "central")
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (service,) = [s for s in services.values()
                      if s["spec"]["selector"].items() <= labels.items()]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        ports = {p["name"] for p in container["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["resources"]["requests"] and container["resources"]["limits"]
        mounted = {v["configMap"]["name"] for v in workload["spec"]["template"]["spec"].get("volumes", [])
                   if "configMap" in v}
        for name in mounted:
            _find(objects, "ConfigMap", name)
    vmalert = _find(objects, "Deployment", "vmalert")["spec"]["template"]["spec"]
    flags = _flags(vmalert["containers"][0]["args"])
    for key in ("datasource.url", "remoteWrite.url", "remoteRead.url", "notifier.url"):
        url = urlparse(flags[key])
        assert url.port in {p["port"] for p in services[str(url.hostname)]["spec"]["ports"]}, key
    assert "disableAlertgroupLabel" in flags
    (mount,) = vmalert["containers"][0]["volumeMounts"]
    assert flags["rule"] == f"{mount['mountPath']}/{CENTRAL_RULES.name}"
    rules = _find(objects, "ConfigMap", "gpumon-rules")["data"]
    assert rules == {CENTRAL_RULES.name: CENTRAL_RULES.read_text()}
    config = _find(objects, "ConfigMap", "alertmanager-config")["data"]["alertmanager.yml"]
    assert config == (ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text()
