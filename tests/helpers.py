"""What tests share beyond fixtures: the harness in gpumon.testing (also used by the
benchmarks), and where the repository is."""

from __future__ import annotations

from pathlib import Path

from gpumon.testing import (  # noqa: F401  (re-exported for the tests)
    AgentProcess,
    PrometheusProcess,
    agent_env,
    free_port,
    http_get,
    launch_service,
    library_agent,
    parse_metrics,
    require_tool,
    scrape_metrics,
    scrape_text,
    start_agent,
    start_prometheus,
    terminate,
    value,
    values,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent
