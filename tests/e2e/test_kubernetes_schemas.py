"""Every Kubernetes object in deploy/ (the node DaemonSet, the sidecar example, the fleet's shard
and central parts) passes the Kubernetes API's own schemas, strictly: an unknown or misspelt
field fails as ``kubectl apply --validate=strict`` would. The Prometheus Operator's resources
(``monitoring.coreos.com``) have no schema in the API's; their fields are checked by
test_deploy.py and test_fleet_deploy.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.helpers import ROOT

KUBERNETES_VERSION = "1.30.0"
"""The oldest Kubernetes the manifests are written for (sidecar containers, ``restartPolicy:
Always`` on an init container, are on by default from 1.29)."""
OPERATOR_GROUP = "monitoring.coreos.com/"


def _manifests() -> list[Path]:
    return sorted(p for p in (ROOT / "deploy").rglob("*.yaml")
                  if "kubernetes" in p.relative_to(ROOT / "deploy").parts
                  and p.name != "kustomization.yaml")


def _objects() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{path.relative_to(ROOT)}:{doc['kind']}/{doc['metadata']['name']}", doc)
            for path in _manifests() for doc in yaml.safe_load_all(path.read_text()) if doc]


API_OBJECTS = [(name, doc) for name, doc in _objects()
               if not doc["apiVersion"].startswith(OPERATOR_GROUP)]


def test_the_manifests_are_found() -> None:
    kinds = {doc["kind"] for _, doc in API_OBJECTS}
    assert kinds >= {"Namespace", "DaemonSet", "Service", "Job", "StatefulSet", "Deployment",
                     "ConfigMap", "ServiceAccount", "Role", "RoleBinding"}, kinds
    operator = {doc["kind"] for _, doc in _objects() if doc["apiVersion"].startswith(OPERATOR_GROUP)}
    assert operator == {"ServiceMonitor", "PodMonitor", "PrometheusRule", "Prometheus"}, operator


@pytest.mark.parametrize("name,doc", API_OBJECTS, ids=[name for name, _ in API_OBJECTS])
def test_object_passes_the_api_schema(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def _daemonset() -> dict[str, Any]:
    (doc,) = [doc for _, doc in API_OBJECTS if doc["kind"] == "DaemonSet"]
    return copy.deepcopy(doc)


def test_a_misspelt_field_fails() -> None:
    doc = _daemonset()
    doc["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # "resources"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_wrong_type_fails() -> None:
    doc = _daemonset()
    doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "metrics"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
