"""OpenMetrics from a real agent with training steps: negotiated on ``Accept``, valid by
prometheus_client's OpenMetrics parser, the same series as the text format, family names that
collide with no other family's samples, and a real Prometheus that asks for OpenMetrics gets it."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families as text_families

from gpumon.agent.lifecycle import Agent
from gpumon.export.exposition import (
    CounterFamily,
    GaugeFamily,
    HistogramFamily,
    render_openmetrics,
)
from gpumon.export.server import wants_openmetrics
from gpumon.testing.agent import library_agent
from tests.export.test_exposition import _both, _Registry
from tests.helpers import http_get, require_tool, start_prometheus, wait_for

OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
STEPS = 12
SUFFIXES = ("_total", "_created", "_info", "_bucket", "_count", "_sum", "_gcount", "_gsum")
VARIABLE = ("gpumon_agent_process_", "gpumon_collector_", "gpumon_host_", "gpumon_rank_stalled",
            "gpumon_http_", "gpumon_recording_")
"""Series whose values move between two scrapes a moment apart."""


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """An agent on two simulated GPUs, recording, fed 12 steps of one rank: every family."""
    tmp = tmp_path_factory.mktemp("openmetrics")
    with library_agent(tmp / "s.sock", simulate=2, interval=0.2,
                       record=str(tmp / "run.jsonl")) as node:
        uuid = node.state.gpu_statics()[0].uuid
        start = time.time() - STEPS * 0.25
        records = [{"v": 1, "kind": "step", "run": "job", "rank": 0, "step": n,
                    "t_start": start + n * 0.25, "duration": 0.25, "gpu": uuid, "world": 1,
                    "phases": {"data": 0.15, "forward": 0.04, "backward": 0.05,
                               "optimizer": 0.01},
                    "memory": {"allocated": 2**30, "reserved": 2**31, "peak": 2**30}}
                   for n in range(STEPS)]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps(records).encode(), node.config.socket)
        wait_for(lambda: 'gpumon_step_bottleneck_current{' in scrape(node)[2].decode(),
                 what="a verdict")
        yield node


def scrape(agent: Agent, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body as sent) of /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=headers or {})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def samples(families: Iterator[Any]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in families for s in f.samples if not s.name.startswith(VARIABLE)}


def test_accept_headers_choose_the_format() -> None:
    prometheus = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                  "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    assert wants_openmetrics(prometheus)
    assert wants_openmetrics("application/openmetrics-text")
    assert not wants_openmetrics("")
    assert not wants_openmetrics("*/*")
    assert not wants_openmetrics("text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.5")
    assert not wants_openmetrics("application/openmetrics-text;version=2.0.0")
    assert not wants_openmetrics("application/openmetrics-text;q=0")


def test_openmetrics_scrape_is_valid_and_holds_what_the_text_format_holds(agent: Agent) -> None:
    status, content_type, body = scrape(agent, {"Accept": OPENMETRICS})
    assert status == 200
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert text.endswith("\n# EOF\n")
    families = {f.name: f for f in openmetrics_families(text)}  # raises on invalid input
    assert families["gpumon_step_bottleneck"].type == "counter"
    assert families["gpumon_step_bottleneck_current"].type == "gauge"
    assert families["gpumon_steps"].samples[0].value == STEPS
    assert families["gpumon_gpu"].type == "info"
    assert families["gpumon_step_duration_seconds"].type == "histogram"
    current = {s.labels["bottleneck"]: s.value
               for s in families["gpumon_step_bottleneck_current"].samples}
    assert sum(current.values()) == 1 and current["input"] == 1

    status, content_type, plain = scrape(agent, {"Accept": "text/plain"})
    assert status == 200 and content_type.startswith("text/plain;")
    assert samples(text_families(plain.decode())) == samples(openmetrics_families(text))


def test_gzip_in_both_formats(agent: Agent) -> None:
    for accept, parse in ((OPENMETRICS, openmetrics_families), ("text/plain", text_families)):
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
        conn.request("GET", "/metrics", headers={"Accept": accept, "Accept-Encoding": "gzip"})
        response = conn.getresponse()
        body = response.read()
        conn.close()
        assert response.getheader("Content-Encoding") == "gzip"
        assert any(f.name == "gpumon_step_bottleneck_current"
                   for f in parse(gzip.decompress(body).decode()))


def test_no_family_name_collides_and_the_registry_knows_them_all(agent: Agent) -> None:
    text = scrape(agent, {"Accept": OPENMETRICS})[2].decode()
    scraped = list(openmetrics_families(text))
    names = {f.name for f in scraped}
    taken = {s.name: f.name for f in scraped for s in f.samples}
    for name in names:
        for other in (name + suffix for suffix in SUFFIXES):
            assert taken.get(other, name) == name, f"{other} of {taken[other]} collides with {name}"
        assert taken.get(name, name) == name
    for name in names:  # the registry refuses a family that would clash with one it holds
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            Gauge(name, "a clash", registry=agent.registry)


def test_promtool_finds_nothing_in_a_scrape_with_steps(agent: Agent) -> None:
    promtool = require_tool("promtool")
    body = scrape(agent, {"Accept": "text/plain"})[2].decode()
    result = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
        result.stdout + result.stderr


def test_prometheus_negotiates_openmetrics(agent: Agent, tmp_path: Path) -> None:
    """Metadata proves the format: OpenMetrics names a counter's family ``gpumon_steps``, the
    text format ``gpumon_steps_total``."""
    prometheus = start_prometheus(tmp_path, [f"127.0.0.1:{agent.port}"])
    try:
        steps = wait_for(lambda: prometheus.query('gpumon_steps_total{run="job"}'),
                         timeout=30, what="steps scraped by Prometheus")
        assert float(steps[0]["value"][1]) == STEPS
        status, body = http_get(f"{prometheus.url}/api/v1/targets")
        target = json.loads(body)["data"]["activeTargets"][0]
        assert (status, target["health"], target["lastError"]) == (200, "up", "")

        def metadata(metric: str) -> list[dict[str, str]]:
            query = urllib.parse.urlencode({"metric": metric})
            status, body = http_get(f"{prometheus.url}/api/v1/targets/metadata?{query}")
            assert status == 200, body
            return list(json.loads(body)["data"])
        assert [m["type"] for m in metadata("gpumon_steps")] == ["counter"]
        assert metadata("gpumon_steps_total") == []
        assert [m["type"] for m in metadata("gpumon_step_bottleneck_current")] == ["gauge"]
    finally:
        prometheus.stop()


def test_row_families_render_as_prometheus_clients_openmetrics_writer_does() -> None:
    """Byte for byte, on the values and labels of the text format's own test."""
    gauge, ref_gauge = _both(GaugeFamily, GaugeMetricFamily, "bench_gauge", ["zone", "a"])
    counter, ref_counter = _both(CounterFamily, CounterMetricFamily, "bench_things",
                                 ["zone", "a"])
    histogram, ref_histogram = (
        HistogramFamily("bench_seconds", 'A "histogram".', labels=["run"]),
        HistogramMetricFamily("bench_seconds", 'A "histogram".', labels=["run"]))
    for family in (histogram, ref_histogram):
        family.add_metric(['r"1'], [("0.5", 1.0), ("2.5", 3.0), ("+Inf", 4.0)], 7.25)
    info = InfoMetricFamily("bench_build", "Info.", value={"version": "1.2"})
    ours = [gauge, counter, histogram, info]
    theirs = [ref_gauge, ref_counter, ref_histogram, info]
    assert render_openmetrics(ours) == openmetrics_latest(_Registry(theirs))
