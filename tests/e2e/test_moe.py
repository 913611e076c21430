"""Mixture-of-experts jobs against a real agent, beside what the jobs measure themselves.

- A tiny Hugging Face Mixtral (``jobs/moe_hf_job.py``), unmodified, under ``gpumon run``: each
  layer's expert load in the agent's ``/metrics`` is what the job computes from the router
  logits the model returns.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumon.client.watchers.expert_window import MOE_WINDOW_STEPS
from gpumon.testing import AgentProcess, scrape_metrics, value
from tests.e2e.distributed import AGENT, JOBS, watched

pytestmark = [pytest.mark.slow, AGENT]


def test_a_hugging_face_mixtral_reads_as_its_router_routed(agent: AgentProcess, tmp_path: Path) -> None:
    steps = MOE_WINDOW_STEPS + 10
    job = watched(agent, tmp_path, "mixtral",
                  [str(JOBS / "moe_hf_job.py"), "--out", str(tmp_path / "mixtral"), "--steps", str(steps),
                   "--window", str(MOE_WINDOW_STEPS)], expect_steps=steps)
    truth = job.summary(0)
    assert truth["window"] == MOE_WINDOW_STEPS
    last = job.steps(0)[-1]["moe"]
    assert last["window"] == MOE_WINDOW_STEPS
    metrics = scrape_metrics(agent)
    assert value(metrics, "gpumon_moe_window_steps", run="mixtral", rank="0") == MOE_WINDOW_STEPS
    skewed = 0
    for layer, own in truth["layers"].items():
        labels = {"run": "mixtral", "rank": "0", "layer": layer}
        assert last["layers"][layer][1] == own["tokens"]
        assert value(metrics, "gpumon_moe_expert_load_max_ratio", **labels) == pytest.approx(
            own["max_ratio"], rel=0.02)
        assert value(metrics, "gpumon_moe_expert_load_cv", **labels) == pytest.approx(own["cv"], rel=0.02)
        assert value(metrics, "gpumon_moe_dead_experts", **labels) == own["dead"]
        assert value(metrics, "gpumon_moe_experts", **labels) == 8
        skewed += own["max_ratio"] > 1.2
    assert skewed  # the job's skewed routers still read as skewed: not a balanced default
