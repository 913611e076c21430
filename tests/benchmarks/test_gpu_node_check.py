"""The device script's dry run: on the fake NVML, without CUDA, every section runs (or says
why it cannot), no section errors, and the checks that need no GPU pass. The same script runs
unchanged on a GPU node; here it proves the code paths and the files it brings back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_node_check.py"


@pytest.mark.slow
def test_dry_run_on_the_fake_nvml_passes_every_check_it_can(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--nvml", "fake", "--quick",
         "--budget-s", "280"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nvml_mode"] == "fake"
    assert "watchdog" not in summary, summary.get("watchdog")
    sections = summary["sections"]
    errors = {name: s.get("error") for name, s in sections.items() if s.get("status") == "error"}
    assert not errors, errors
    for name in ("environment", "nvml", "agent_start", "training", "endpoints", "owners", "overhead",
                 "oom", "oom_event", "stall", "deepspeed", "run", "trace", "replay", "agent_stop",
                 "functional", "p2p", "moe", "goodput"):
        assert sections[name]["status"] == "ok", (name, sections[name])
    # Sections that depend on parts still to come say so instead of failing.
    for name in ("ddp", "memory"):
        status = sections[name]["status"]
        assert status == "ok" or status.startswith("skipped: not available"), (name, status)
    checks = summary["checks"]
    failed = [name for name, c in checks.items() if c["ok"] is False]
    assert not failed, {name: checks[name]["detail"] for name in failed}
    for name in ("nvml.gpu0.essentials", "nvml.gpumon_matches_raw_calls", "agent.steps_arrived",
                 "agent.verdict_metrics", "hook.phase_sum_vs_step_time", "oom.event_counted",
                 "replay.classify_recording", "agent.clean_exit", "agent.log_without_errors",
                 "stall.host_case_stalled", "stall.host_case_place",
                 "deepspeed.one_step_per_optimizer_step", "deepspeed.phases_from_the_engine",
                 "deepspeed.samples_summed_over_micro_batches",
                 "deepspeed.optimizer_states_hold_the_master_copy", "deepspeed.framework_exported",
                 "run.one_step_per_optimizer_step", "run.hooks_are_the_cores_own",
                 "owners.rank_names_node_and_user",
                 "trace.request_taken", "trace.written", "trace.phase_ranges_match_records",
                 "trace.hta_loads", "functional.counted_and_sized",
                 "functional.comm_on_every_step", "p2p.receives_counted_with_a_bubble",
                 "p2p.sends_counted", "goodput.a_checkpoint", "goodput.saves_counted",
                 "goodput.checkpoint_time", "goodput.finished_keeps_all",
                 "nvml.xid_wait_times_out", "nvml.xid_check_returns_at_once",
                 "nvml.stream_hands_every_gpu_on", "nvml.inline_round_on_the_clock"):
        assert checks[name]["ok"] is True, (name, checks[name])
    brought_back = {p.name for p in out.iterdir()}
    assert {"summary.json", "summary.md", "agent.log", "recording.jsonl.gz",
            "metrics_after_training.txt", "metrics_oom.txt", "metrics_owners.txt",
            "trace_rank0.pt.trace.json.gz"} <= brought_back, brought_back
    markdown = (out / "summary.md").read_text()
    assert "## Raw NVML calls, GPU 0" in markdown and "## OOM-risk series" in markdown
