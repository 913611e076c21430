"""The agent as a library on simulated GPUs: exposition, JSON views, moving counters."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumon.agent import Agent
from tests.helpers import (
    http_get,
    library_agent,
    parse_metrics,
    require_tool,
    scrape_text,
    value,
    values,
    wait_for,
)


@pytest.fixture
def sim_agent(tmp_path: Path) -> Iterator[Agent]:
    with library_agent(tmp_path / "ingest.sock", simulate=2, interval=0.2) as agent:
        yield agent


scrape = scrape_text


def test_every_gpu_series_present_in_base_units(sim_agent: Agent) -> None:
    wait_for(lambda: "gpumon_gpu_power_watts" in scrape(sim_agent), what="first GPU sample")
    metrics = parse_metrics(scrape(sim_agent))
    for gpu in ("0", "1"):
        assert value(metrics, "gpumon_gpu_up", gpu=gpu) == 1
        assert 0 <= value(metrics, "gpumon_gpu_utilization_ratio", gpu=gpu) <= 1
        assert value(metrics, "gpumon_gpu_memory_total_bytes", gpu=gpu) == 80 * 1024**3
        assert 1e9 < value(metrics, "gpumon_gpu_sm_clock_hertz", gpu=gpu) < 3e9
        assert 50 < value(metrics, "gpumon_gpu_power_watts", gpu=gpu) <= 700
    assert value(metrics, "gpumon_nvml_up") == 1
    assert value(metrics, "gpumon_agent_info", version="0.1.0") == 1
    assert value(metrics, "gpumon_host_memory_total_bytes") > 0
    assert len(values(metrics, "gpumon_gpu_info")) == 2


def test_counters_move(sim_agent: Agent) -> None:
    wait_for(lambda: "gpumon_gpu_nvlink_transmit_bytes_total" in scrape(sim_agent))
    first = value(parse_metrics(scrape(sim_agent)), "gpumon_gpu_nvlink_transmit_bytes_total",
                  gpu="0")
    time.sleep(0.6)
    second = value(parse_metrics(scrape(sim_agent)), "gpumon_gpu_nvlink_transmit_bytes_total",
                   gpu="0")
    assert second > first


def test_promtool_check_metrics_is_clean(sim_agent: Agent) -> None:
    promtool = require_tool("promtool")
    wait_for(lambda: "gpumon_gpu_power_watts" in scrape(sim_agent))
    result = subprocess.run([promtool, "check", "metrics"], input=scrape(sim_agent),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


def test_json_views(sim_agent: Agent) -> None:
    url = f"http://127.0.0.1:{sim_agent.port}"
    wait_for(lambda: http_get(url + "/readyz")[0] == 200, what="readiness")
    status, body = http_get(url + "/readyz")
    assert json.loads(body) == {"status": "ok", "problems": []}
    status, body = http_get(url + "/api/v1/snapshot")
    snapshot = json.loads(body)
    assert status == 200
    assert [g["index"] for g in snapshot["gpus"]] == [0, 1]
    assert snapshot["nvml"]["simulated"] is True
    assert http_get(url + "/healthz") == (200, b"ok\n")
    assert http_get(url + "/nope")[0] == 404
