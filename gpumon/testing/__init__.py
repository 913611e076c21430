"""Test and benchmark harness for gpumon, shared by ``tests/`` and ``benchmarks/`` (as
``numpy.testing`` is for numpy): a real agent in a subprocess or in-process, a free port and
a GET, the Prometheus text parser and lookups, nearest-rank quantiles, Prometheus itself,
and the fake NVML library (``gpumon.testing.fakenvml``).

It may import any gpumon layer, and no layer imports it; it never imports pytest, so a
benchmark script can use it as it is. Its failures are AssertionErrors with the log of what
failed to start, which pytest reports as such and a benchmark prints.
"""

from __future__ import annotations

from gpumon.testing.agent import (
    IMPORT_ROOT,
    AgentProcess,
    agent_env,
    library_agent,
    scrape_metrics,
    scrape_text,
    start_agent,
)
from gpumon.testing.metrics import Metrics, first, parse_metrics, series, value, values
from gpumon.testing.net import free_port, http_get, wait_for
from gpumon.testing.services import (
    PrometheusProcess,
    launch_service,
    require_tool,
    start_prometheus,
    terminate,
)
from gpumon.testing.stats import quantile

__all__ = [
    "IMPORT_ROOT",
    "AgentProcess",
    "Metrics",
    "PrometheusProcess",
    "agent_env",
    "first",
    "free_port",
    "http_get",
    "launch_service",
    "library_agent",
    "parse_metrics",
    "quantile",
    "require_tool",
    "scrape_metrics",
    "scrape_text",
    "series",
    "start_agent",
    "start_prometheus",
    "terminate",
    "value",
    "values",
    "wait_for",
]
