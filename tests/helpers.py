"""What tests share beyond fixtures: the harness in gpumon.testing (also used by the
benchmarks), where the repository is, and reading back what a client sent."""

from __future__ import annotations

from pathlib import Path

from gpumon.client.core.transport import MemoryTransport
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
from gpumon.wire import StepRecord

ROOT = Path(__file__).resolve().parent.parent

RECORDING = "recording.jsonl"
"""Where an agent started with ``@pytest.mark.agent(record=True)`` records, under the test's
``tmp_path``."""


def steps_of(transport: MemoryTransport) -> list[StepRecord]:
    """The step records a client sent to an in-memory transport, in order."""
    return [r for r in transport.records() if isinstance(r, StepRecord)]
