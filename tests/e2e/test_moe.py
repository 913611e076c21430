"""Mixture-of-experts jobs against a real agent, beside what the jobs measure themselves.

- A tiny Hugging Face Mixtral (``jobs/moe_hf_job.py``), unmodified, under ``gpumon run``: each
  layer's expert load in the agent's ``/metrics`` is what the job computes from the router
  logits the model returns.
- A torch-native expert-parallel layer (``jobs/moe_ep_job.py``, two ranks on gloo,
  ``all_to_all_single`` dispatch) reporting through ``mon.expert_load``, its routing skewed by
  construction: the ratio and dead experts exact, its all-to-alls measured as issued, and the
  rank holding the busy experts read as the one its peer waits for.
- DeepSpeed-MoE (``jobs/moe_deepspeed_job.py``) on CPU under ``gpumon run``: each rank's layer
  as its gate's own ``exp_counts``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumon.client.watchers.expert_window import MOE_WINDOW_STEPS
from gpumon.report.page import render
from gpumon.report.recording import load_file
from gpumon.testing import AgentProcess, scrape_metrics, value
from tests.e2e.distributed import AGENT, JOBS, flagged_share, run_job, watched

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
    # gpumon report draws each layer over time from the recording.
    model = load_file(job.recording, run="mixtral")
    assert sorted(model.moe_ratio) == sorted(truth["layers"])
    page = render(model)
    assert 'id="moe"' in page and "layer 2" in page


def _figures(counts: list[int]) -> tuple[float, float, int]:
    mean = sum(counts) / len(counts)
    std = (sum((c - mean) ** 2 for c in counts) / len(counts)) ** 0.5
    return max(counts) / mean, std / mean, counts.count(0)


def test_expert_parallel_routing_skewed_by_construction(agent: AgentProcess, tmp_path: Path) -> None:
    """Two expert-parallel ranks, the experts of rank 0 the busy ones: each rank's ratio is the
    one its own routing makes, its all-to-alls are those it issued, and rank 0 is the rank its
    peer waits for."""
    steps = 40
    job = run_job(agent, tmp_path, "moe_ep_job.py", 2, ["--steps", str(steps)], run="moe-ep",
                  expect_steps=2 * steps)
    metrics = scrape_metrics(agent)
    for rank in (0, 1):
        truth = job.summary(rank)
        window = truth["counts"][-MOE_WINDOW_STEPS:]
        ratio, cv, dead = _figures([sum(step[e] for step in window) for e in range(4)])
        labels = {"run": "moe-ep", "rank": str(rank), "layer": "0"}
        assert value(metrics, "gpumon_moe_expert_load_max_ratio", **labels) == pytest.approx(ratio, abs=1e-6)
        assert ratio == pytest.approx(2.5)  # the construction's 40 of 64 tokens over 16
        assert value(metrics, "gpumon_moe_expert_load_cv", **labels) == pytest.approx(cv, abs=1e-6)
        assert value(metrics, "gpumon_moe_dead_experts", **labels) == dead == 1
        for record, sizes in zip(job.steps(rank), truth["all_to_all_bytes"], strict=True):
            count, size, _ = record["comm"]["ops"]["all_to_all"]
            assert (count, size) == (len(sizes), sum(sizes))
    # Rank 0 holds the busy experts: it computes while rank 1 waits for it in the all-to-all.
    assert flagged_share(job.verdicts(0)[WARMUP:]) > 0.5
    assert flagged_share(job.verdicts(1)) == 0
    assert value(metrics, "gpumon_rank_straggler_score", run="moe-ep", rank="0") < 0.75
    # gpumon report: the layer's load over time beside each rank's all-to-all time.
    model = load_file(job.recording, run="moe-ep")
    assert list(model.moe_ratio) == ["0"] and sorted(model.all_to_all) == [0, 1]
    assert 'id="moe"' in render(model)


WARMUP = 24  # steps before the straggler rule has its window


def test_deepspeed_moe_reads_as_its_gate_counted(agent: AgentProcess, tmp_path: Path) -> None:
    """DeepSpeed-MoE runs on the CPU (``DS_ACCELERATOR=cpu``, gloo): unmodified, under ``gpumon
    run``, each rank's layer reads as its gate's own ``exp_counts`` over the window."""
    steps = MOE_WINDOW_STEPS + 10
    job = watched(agent, tmp_path, "ds-moe",
                  [str(JOBS / "moe_deepspeed_job.py"), "--out", str(tmp_path / "ds-moe"), "--steps",
                   str(steps), "--window", str(MOE_WINDOW_STEPS)], expect_steps=2 * steps, torchrun=2)
    metrics = scrape_metrics(agent)
    for rank in (0, 1):
        own = job.summary(rank)["layer"]
        (layer, figures), = job.steps(rank)[-1]["moe"]["layers"].items()
        assert figures[1] == own["tokens"]
        labels = {"run": "ds-moe", "rank": str(rank), "layer": layer}
        assert value(metrics, "gpumon_moe_expert_load_max_ratio", **labels) == pytest.approx(
            own["max_ratio"], rel=0.02)
        assert value(metrics, "gpumon_moe_expert_load_cv", **labels) == pytest.approx(own["cv"], rel=0.02)
        assert value(metrics, "gpumon_moe_dead_experts", **labels) == own["dead"]
