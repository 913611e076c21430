"""deploy/: manifests parse and hang together, the PrometheusRule matches alerts/, Alertmanager's
example passes amtool, the compose stack and systemd unit point at what exists."""

from __future__ import annotations

import configparser
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from gpumon.client.core.run_name import K8S_VARIABLES, resolve_run_name
from tests.helpers import ROOT, require_tool

DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
ALERTMANAGER_CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"
COMPOSE = DEPLOY / "compose"
PORT = 9403
SOCKET_DIR = "/run/gpumon"
NAMESPACED = {"DaemonSet", "Service", "ServiceMonitor", "PodMonitor", "PrometheusRule", "Job"}


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _objects() -> list[dict[str, Any]]:
    return [doc for path in sorted(KUBE.glob("*.yaml")) for doc in _documents(path)
            if doc["kind"] != "Kustomization"]


def _one(kind: str) -> dict[str, Any]:
    found = [obj for obj in _objects() if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_prometheusrule",
                                                  DEPLOY / "generate_prometheusrule.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _agent_job_regex() -> re.Pattern[str]:
    """The job selector of GpumonAgentDown, the one place that names the scrape job."""
    rules = [rule for path in (ROOT / "alerts").glob("*.rules.yml")
             for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]
    (expr,) = [rule["expr"] for rule in rules if rule.get("alert") == "GpumonAgentDown"]
    match = re.search(r'up\{job=~"([^"]+)"\}', expr)
    assert match, expr
    return re.compile(match[1])


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    assert _documents(path), f"{path} holds no document"


def test_no_machine_specific_paths() -> None:
    for path in [*DEPLOY.rglob("*"), *(ROOT / "docs").rglob("*")]:
        if path.is_file() and path.suffix not in (".pyc", ".png"):
            text = path.read_text()
            assert not re.search(r"/(work|home|Users)/", text), f"machine-specific path in {path}"


def test_kubernetes_objects_are_complete() -> None:
    objects = _objects()
    assert {obj["kind"] for obj in objects} >= {"Namespace", "DaemonSet", "Service",
                                               "ServiceMonitor", "PrometheusRule", "Job",
                                               "PodMonitor"}
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind"), obj
        assert obj.get("metadata", {}).get("name"), obj
        if obj["kind"] in NAMESPACED:
            assert obj["metadata"].get("namespace"), obj["metadata"]["name"]


def test_kustomization_lists_the_manifests() -> None:
    (kustomization,) = _documents(KUBE / "kustomization.yaml")
    listed = set(kustomization["resources"])
    present = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml",
                                                        "sidecar-example.yaml"}
    assert listed == present


def _agent_container(pod: dict[str, Any]) -> dict[str, Any]:
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    agents: list[dict[str, Any]] = [c for c in containers
                                    if c["image"].startswith("ghcr.io/gpumon/gpumon")
                                    and c.get("args") == ["agent"]]
    assert len(agents) == 1, agents
    return agents[0]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_daemonset() -> None:
    ds = _one("DaemonSet")
    assert ds["apiVersion"] == "apps/v1"
    template = ds["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod = template["spec"]
    # The host's pids: each sender's process, its exit and its cgroup (docs/security.md).
    assert pod["hostPID"] is True
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        assert container["image"], container["name"]
        assert container["resources"]["requests"] and container["resources"]["limits"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert "nvidia.com/gpu" not in str(container["resources"]), "the agent must not take a GPU"
    agent = _agent_container(pod)
    assert {"name": "metrics", "containerPort": PORT, "protocol": "TCP"} in agent["ports"]
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    env = _env(agent)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["GPUMON_SOCKET"] == f"{SOCKET_DIR}/ingest.sock"
    assert env["GPUMON_PORT"] == str(PORT)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    (socket_volume,) = [name for name, path in mounts.items() if path == SOCKET_DIR]
    assert volumes[socket_volume]["hostPath"]["path"] == SOCKET_DIR
    # kubelet's names, read-only: the PodResources socket and the container links.
    read_only = {m["mountPath"]: m["name"] for m in agent["volumeMounts"] if m.get("readOnly")}
    for path in ("/var/lib/kubelet/pod-resources", "/var/log/containers"):
        assert volumes[read_only[path]]["hostPath"]["path"] == path
    assert env["GPUMON_POD_RESOURCES_SOCKET"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    (node_name,) = [e for e in agent["env"] if e["name"] == "GPUMON_NODE_NAME"]
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_service_selects_the_daemonset() -> None:
    service, ds = _one("Service"), _one("DaemonSet")
    selector = service["spec"]["selector"]
    assert selector and selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["port"] == PORT and port["targetPort"] == "metrics"


def test_servicemonitor_scrapes_the_service() -> None:
    monitor, service = _one("ServiceMonitor"), _one("Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    port_names = {port["name"] for port in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
    # Its job label is the Service's name: GpumonAgentDown must watch it.
    assert _agent_job_regex().fullmatch(service["metadata"]["name"])


def test_sidecar_example_shares_the_socket() -> None:
    job = _one("Job")
    pod = job["spec"]["template"]["spec"]
    agent = _agent_container(pod)
    assert agent.get("restartPolicy") == "Always", "the agent should be a native sidecar"
    (train,) = pod["containers"]
    socket_path = _env(agent)["GPUMON_SOCKET"]
    assert _env(train)["GPUMON_SOCKET"] == socket_path
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in (agent, train):
        (mount,) = [m for m in container["volumeMounts"] if socket_path.startswith(m["mountPath"] + "/")]
        assert "emptyDir" in volumes[mount["name"]], container["name"]
    assert {m["name"] for m in agent["volumeMounts"]} & {m["name"] for m in train["volumeMounts"]}
    monitor = _one("PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        job["spec"]["template"]["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= \
        {p["name"] for p in agent["ports"]}
    namespace, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    assert _agent_job_regex().fullmatch(f"{namespace}/{name}")


def test_sidecar_example_names_the_run_after_its_job() -> None:
    """The Downward API variables, resolved as the kubelet would for this Job's pod (the
    labels the Job controller adds; a label the pod lacks gives an empty value), name the run
    ``namespace/job`` through the same code the hook runs."""
    job = _one("Job")
    (train,) = job["spec"]["template"]["spec"]["containers"]
    assert "GPUMON_RUN" not in _env(train)
    meta = {"metadata.namespace": job["metadata"]["namespace"], "metadata.name": "llama-sft-x7k2p",
            "metadata.labels['batch.kubernetes.io/job-name']": job["metadata"]["name"]}
    env = {e["name"]: meta.get(e["valueFrom"]["fieldRef"]["fieldPath"], "")
           for e in train["env"] if "valueFrom" in e}
    assert set(env) == {"GPUMON_K8S_NAMESPACE", *K8S_VARIABLES} - {"GPUMON_K8S_WORKLOAD"}
    assert resolve_run_name(env, ["torchrun", "train.py"]) == ("training/llama-sft", "GPUMON_K8S_JOB")


def test_prometheusrule_is_in_sync_with_alerts() -> None:
    generator = _load_generator()
    assert (KUBE / "prometheusrule.yaml").read_text() == generator.render(), (
        "deploy/kubernetes/prometheusrule.yaml is stale: run python deploy/generate_prometheusrule.py")
    rule = _one("PrometheusRule")
    groups = [group for path in sorted((ROOT / "alerts").glob("*.rules.yml"))
              for group in yaml.safe_load(path.read_text())["groups"]]
    assert rule["spec"]["groups"] == groups


def test_prometheusrule_passes_promtool(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": _one("PrometheusRule")["spec"]["groups"]}))
    result = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alertmanager_config_passes_amtool() -> None:
    amtool = require_tool("amtool")
    result = subprocess.run([amtool, "check-config", str(ALERTMANAGER_CONFIG)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(("labels", "receiver"), [
    (["severity=critical", "alertname=GpumonTrainingOOM"], "pager"),
    (["severity=warning", "alertname=GpumonInputBound"], "team-chat"),
    (["severity=info", "alertname=GpumonLowMFU"], "team-digest"),
])
def test_alertmanager_routes_by_severity(labels: list[str], receiver: str) -> None:
    amtool = require_tool("amtool")
    result = subprocess.run([amtool, "config", "routes", "test",
                             f"--config.file={ALERTMANAGER_CONFIG}", *labels],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == [receiver]


def test_alertmanager_inhibits_warning_by_critical() -> None:
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    rules = config["inhibit_rules"]
    assert any(rule["source_matchers"] == ['severity="critical"']
               and rule["target_matchers"] == ['severity="warning"']
               and {"alertname", "instance", "run"} <= set(rule["equal"]) for rule in rules)


def test_compose_stack() -> None:
    (compose,) = _documents(COMPOSE / "docker-compose.yml")
    services = compose["services"]
    assert {"gpumon", "gpumon-simulated", "prometheus", "alertmanager", "grafana"} <= set(services)
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), f"{name}: {source} does not exist"
        build = service.get("build")
        if build:
            assert (COMPOSE / build["context"] / build["dockerfile"]).is_file(), name
    assert "9403:9403" in services["gpumon"]["ports"]
    assert services["gpumon-simulated"]["command"][:2] == ["agent", "--simulate"]
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    dashboards_in_container = grafana_mounts["../../dashboards"]
    (provider_file,) = (COMPOSE / "grafana" / "provisioning" / "dashboards").glob("*.yml")
    (provider,) = yaml.safe_load(provider_file.read_text())["providers"]
    assert provider["options"]["path"] == dashboards_in_container
    (datasource,) = yaml.safe_load(next((COMPOSE / "grafana" / "provisioning" / "datasources")
                                        .glob("*.yml")).read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    rules_mount = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])["../../alerts"]
    prometheus = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    assert prometheus["rule_files"] == [f"{rules_mount}/*.rules.yml"]
    (job,) = prometheus["scrape_configs"]
    assert _agent_job_regex().fullmatch(job["job_name"])


def test_compose_prometheus_config_passes_promtool() -> None:
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "config", str(COMPOSE / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_systemd_unit_is_hardened() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string((DEPLOY / "systemd" / "gpumon.service").read_text())
    service = unit["Service"]
    assert service["User"] == "gpumon" and service["Group"] == "gpumon"
    assert service["RuntimeDirectory"] == "gpumon"
    assert f"--socket {SOCKET_DIR}/ingest.sock" in service["ExecStart"]
    for key, value in {"ProtectSystem": "strict", "NoNewPrivileges": "yes", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "CapabilityBoundingSet": "",
                       "RestrictSUIDSGID": "yes"}.items():
        assert service[key] == value, key
    assert "PrivateDevices" not in service, "NVML needs /dev/nvidia*"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    sysusers = (DEPLOY / "systemd" / "gpumon.sysusers").read_text()
    assert re.search(r"^u gpumon ", sysusers, re.M) and re.search(r"^g gpumon ", sysusers, re.M)


def test_systemd_socket_unit_holds_the_agents_socket_across_restarts() -> None:
    """The socket unit binds what the agent would (path, mode, group, credentials), and the
    service restarts on it without removing the directory the socket lives in."""
    units = {}
    for name in ("gpumon.socket", "gpumon.service"):
        unit = configparser.ConfigParser(interpolation=None, strict=True)
        unit.optionxform = str  # type: ignore[assignment,method-assign]
        unit.read_string((DEPLOY / "systemd" / name).read_text())
        units[name] = unit
    sock, service = units["gpumon.socket"]["Socket"], units["gpumon.service"]
    assert sock["ListenDatagram"] == f"{SOCKET_DIR}/ingest.sock"
    assert f"--socket {sock['ListenDatagram']}" in service["Service"]["ExecStart"]
    assert (sock["SocketMode"], sock["SocketGroup"], sock["PassCredentials"]) == ("0660", "gpumon", "yes")
    assert service["Unit"]["Requires"] == "gpumon.socket"
    assert service["Service"]["RuntimeDirectoryPreserve"] == "yes"
    assert service["Service"]["Restart"] == "always"


def test_image_runs_the_agent_unprivileged() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert user.split(":")[0] not in ("0", "root")
    assert re.search(rf"^EXPOSE {PORT}$", dockerfile, re.M)
    assert 'ENTRYPOINT ["gpumon"]' in dockerfile


def test_slurm_and_scaling_notes() -> None:
    slurm = (DEPLOY / "slurm" / "README.md").read_text()
    assert "`SLURM_JOB_ID` (run `slurm-1234`)" in slurm and SOCKET_DIR in slurm
    assert "Prolog" in slurm and "Epilog" in slurm
    scaling = (ROOT / "docs" / "scaling.md").read_text()
    for word in ("federat", "remote-write", "Thanos", "Mimir", "VictoriaMetrics"):
        assert word in scaling, word
