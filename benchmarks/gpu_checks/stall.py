"""A stalled rank on the GPU told apart from one stalled on the host, through the agent.

Two child processes (``stall_job.py``) each run a watched world-size-1 DDP job through the hook
(NCCL on a GPU, gloo for a dry run) against the running agent, with the stall floor at 1 s,
then stop the way a hung rank does:

- ``device``: a kernel that spins for minutes is queued before the backward pass, so DDP's
  all-reduce waits behind it on the GPU while the host runs ahead and waits in
  ``wait_for_gpu()`` for the loss. The agent must say: stalled, in ``all_reduce`` with its
  kernels not passed on the GPU (``on_device``).
- ``host``: the training thread blocks in ``load_from_host()`` with nothing queued on the GPU.
  The agent must say: stalled at ``load_from_host``, no collective in flight.

The device case needs CUDA; a dry run runs the host case only (the device one is info).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpumon.testing import AgentProcess
from gpumon.testing.processes import kill_tree

from .report import Report, jsonable

JOB = Path(__file__).resolve().parent / "stall_job.py"
ROOT = Path(__file__).resolve().parents[2]
STALL_RUN = "gpu-node-check-stall"
DETECT_TIMEOUT_S = 30.0


def section_stall(report: Report, result: dict[str, Any], agent: AgentProcess, device: str) -> None:
    """Run each case and check what the agent says about the stalled rank."""
    cases = ["host"] + (["device"] if device == "cuda" else [])
    if device != "cuda":
        report.check("stall.device_case_in_gpu_collective", None,
                     "needs CUDA: a kernel holding an NCCL all-reduce back (dry run: host case only)")
    for case in cases:
        condition = run_case(agent, case, device, result)
        result[case] = jsonable(condition)
        if case == "host":
            report.check("stall.host_case_stalled", condition.get("state") == "stalled", condition)
            report.check("stall.host_case_place",
                         str(condition.get("location", "")).endswith(" load_from_host")
                         and condition.get("collective") is None,
                         {"location": condition.get("location"),
                          "collective": condition.get("collective")})
        else:
            collective = condition.get("collective") or {}
            report.check("stall.device_case_stalled", condition.get("state") == "stalled", condition)
            report.check("stall.device_case_in_gpu_collective",
                         collective.get("op") == "all_reduce" and collective.get("on_device") is True,
                         {"collective": collective, "location": condition.get("location")})


def run_case(agent: AgentProcess, case: str, device: str, result: dict[str, Any]) -> dict[str, Any]:
    """Start the case's job, wait for the agent to call it stalled (or time out), stop it;
    returns the rank's condition from the agent's snapshot."""
    run = f"{STALL_RUN}-{case}"
    env = {**os.environ, "GPUMON_SOCKET": str(agent.socket_path), "GPUMON_RUN": run,
           "GPUMON_STALL_AFTER_S": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, str(JOB), "--case", case, "--device", device],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    condition: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + DETECT_TIMEOUT_S + 30.0  # start-up, NCCL init, 20 steps
        while time.monotonic() < deadline and child.poll() is None:
            condition = _condition(agent, run)
            if condition.get("state") == "stalled" and condition.get("location"):
                break
            time.sleep(0.5)
    finally:
        kill_tree(child.pid)  # the launcher's workers run in sessions of their own
        output = child.communicate(timeout=30)[0].decode(errors="replace")
        result[f"{case}_output_tail"] = output[-2000:]
    return condition


def _condition(agent: AgentProcess, run: str) -> dict[str, Any]:
    try:
        _, snapshot = agent.json("/api/v1/snapshot")
    except Exception:
        return {}
    for rank in (snapshot or {}).get("ranks") or []:
        if rank.get("run") == run:
            condition: dict[str, Any] = rank.get("condition") or {}
            return condition
    return {}


def markdown(data: dict[str, Any]) -> list[str]:
    """The two cases as the agent saw them."""
    section = data.get("sections", {}).get("stall", {}).get("result") or {}
    lines = []
    for case in ("host", "device"):
        cond = section.get(case)
        if cond:
            lines.append(f"- {case}: {cond.get('state')} in {cond.get('phase')} at "
                         f"{cond.get('location')}, collective {cond.get('collective')}")
    return ["## Stalled ranks: GPU or host", "", *lines, ""] if lines else []
