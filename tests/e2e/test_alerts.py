"""Alert and recording rules: promtool checks them, runs their unit tests, and the contract holds."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest
import yaml

from tests.helpers import ROOT, require_tool

ALERTS_DIR = ROOT / "alerts"
RULE_FILES = sorted(ALERTS_DIR.glob("*.rules.yml"))
TEST_FILES = sorted((ALERTS_DIR / "tests").glob("*.test.yml"))
RUNBOOK_BASE = "https://github.com/gpumon/gpumon/blob/main/docs/runbooks/"

# Alert names are a public interface (docs/architecture.md §10).
PUBLIC_ALERTS = (
    "GpumonTrainingOOM", "GpumonOOMRiskHigh", "GpumonOOMPredicted", "GpumonAllocatorRetries",
    "GpumonInputBound", "GpumonCommunicationBound", "GpumonLowMFU", "GpumonGpuIdleWhileTraining",
    "GpumonStepTimeRegression", "GpumonRankStraggler", "GpumonTrainingStalled", "GpumonXidError",
    "GpumonGpuLost", "GpumonThermalThrottling", "GpumonAgentDown", "GpumonIngestDropping",
    "GpumonRankExited", "GpumonPipelineImbalance", "GpumonGoodputLow", "GpumonWorkAtRisk",
    "GpumonExpertImbalance",
)
SEVERITIES = {"critical", "warning", "info"}
_SERIES = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)?\{(?P<labels>.*)\}$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _rules() -> list[dict[str, Any]]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


def _unit_tests() -> list[dict[str, Any]]:
    return [test for path in TEST_FILES for test in yaml.safe_load(path.read_text())["tests"]]


def _series_labels(series: str) -> dict[str, str]:
    match = _SERIES.match(series.strip())
    assert match, f"cannot parse input series {series!r}"
    return dict(_LABEL.findall(match["labels"]))


def test_rule_files_exist() -> None:
    assert RULE_FILES, "no alerts/*.rules.yml"
    assert TEST_FILES, "no alerts/tests/*.test.yml"


def test_promtool_check_rules() -> None:
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "rules", *map(str, RULE_FILES)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules() -> None:
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "test", "rules", *map(str, TEST_FILES)],
                            capture_output=True, text=True, timeout=120, cwd=ALERTS_DIR / "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(TEST_FILES), result.stdout


def test_every_design_alert_exists() -> None:
    names = {rule["alert"] for rule in _alerts()}
    missing = sorted(set(PUBLIC_ALERTS) - names)
    assert not missing, f"public alerts missing: {missing}"


@pytest.mark.parametrize("rule", _alerts(), ids=lambda rule: rule["alert"])
def test_alert_has_severity_and_annotations(rule: dict[str, Any]) -> None:
    name = rule["alert"]
    assert name.startswith("Gpumon")
    assert rule.get("labels", {}).get("severity") in SEVERITIES, name
    annotations = rule.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        assert annotations.get(key, "").strip(), f"{name}: no {key}"
    # A description quotes what fired: a label and, where there is one, the value.
    assert "{{ $labels." in annotations["description"], name
    assert annotations["runbook_url"] == f"{RUNBOOK_BASE}{name}.md"
    runbook = ROOT / "docs" / "runbooks" / f"{name}.md"
    assert runbook.is_file(), f"{name}: {runbook.relative_to(ROOT)} does not exist"
    assert f"# {name}" in runbook.read_text()


def test_runbooks_only_for_alerts() -> None:
    names = {rule["alert"] for rule in _alerts()}
    pages = {path.stem for path in (ROOT / "docs" / "runbooks").glob("*.md")} - {"README"}
    assert pages == names


def test_recording_rules_follow_the_naming_convention() -> None:
    records = [rule["record"] for rule in _rules() if "record" in rule]
    assert records
    for name in records:
        level, metric, *_ = name.split(":")
        assert level and metric.startswith("gpumon_"), name
    assert len(records) == len(set(records)), "a recording rule is defined twice"


@pytest.mark.parametrize("name", PUBLIC_ALERTS)
def test_every_alert_has_a_firing_case_and_a_near_miss(name: str) -> None:
    """Some evaluation expects it to fire, and some input beside it is expected not to."""
    fires = False
    near_miss = False
    for test in _unit_tests():
        cases = [case for case in test.get("alert_rule_test", []) if case["alertname"] == name]
        if not cases:
            continue
        inputs = [_series_labels(s["series"]) for s in test["input_series"]]
        for case in cases:
            expected = [alert["exp_labels"] for alert in case["exp_alerts"]]
            if not expected:
                near_miss = True
                continue
            fires = True
            for labels in inputs:
                keys = set(labels) & (set().union(*expected) - {"severity"})
                if keys and not any(all(str(alert.get(k)) == labels[k] for k in keys)
                                    for alert in expected):
                    near_miss = True
    assert fires, f"{name}: no promtool case where it fires"
    assert near_miss, f"{name}: no promtool case where it must stay quiet"


def test_runbooks_name_real_dashboard_panels() -> None:
    """Every bold name in a runbook's "Confirm" section is a panel of a shipped dashboard."""
    titles = {panel["title"] for path in (ROOT / "dashboards").glob("*.json")
              for panel in json.loads(path.read_text())["panels"]}
    for rule in _alerts():
        text = (ROOT / "docs" / "runbooks" / f"{rule['alert']}.md").read_text()
        assert "## Confirm" in text and "## What to do" in text, rule["alert"]
        confirm = text.split("## Confirm", 1)[1].split("\n## ", 1)[0]
        named = {" ".join(name.split()) for name in re.findall(r"\*\*(.+?)\*\*", confirm, re.S)}
        assert named, f"{rule['alert']}: the runbook names no panel to look at"
        assert named <= titles, f"{rule['alert']}: no such panel {sorted(named - titles)}"
