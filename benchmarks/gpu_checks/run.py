"""``gpumon run`` on an unmodified CUDA training script (``run_job.py``, no gpumon in it).

The script runs bare and under ``gpumon run --run gpu-node-check-run --socket <agent's>``,
alternating (the order flipping each pair). The checks: the job's stdout is its own JSON
line either way, with the same loss (gpumon changes nothing it computes); one line on stderr
says gpumon is watching; the agent recorded one step per optimizer step, each with the
forward, backward and optimizer phases the hooks found and the DataLoader's samples. The
throughput ratio (under ``gpumon run`` ÷ bare, median of the pairs) is reported against the
≥ 0.99 target; launches of separate processes scatter, so it is information, not a check.
A last check looks at the hooks themselves in a process ``gpumon run`` started: where the C
core was built, the backward and DataLoader hooks are its C objects (``_hook.Hooked``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpumon.testing import AgentProcess

from .hook import read_recording
from .report import Report, jsonable

JOB = Path(__file__).resolve().parent / "run_job.py"
ROOT = Path(__file__).resolve().parents[2]
RUN = "gpu-node-check-run"


def section_run(report: Report, result: dict[str, Any], agent: AgentProcess, device: str) -> None:
    """Launch the script bare and under ``gpumon run`` in pairs; check what the agent recorded."""
    cuda = device == "cuda"
    pairs = 1 if report.quick or not cuda else 2
    width, steps, warmup = (2048, 60, 10) if cuda and not report.quick else (64, 8, 2)
    job = [sys.executable, str(JOB), "--device", device, "--steps", str(steps), "--warmup", str(warmup),
           "--width", str(width), "--layers", "4" if cuda else "2", "--batch", "64" if cuda else "8"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GPUMON_SOCKET", None)
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for pair in range(pairs):
        for watched in ((False, True) if pair % 2 == 0 else (True, False)):
            command = ([sys.executable, "-m", "gpumon.cli", "run", "--run", RUN,
                        "--socket", str(agent.socket_path), "--", *job] if watched else job)
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
            lines = done.stdout.splitlines()
            out = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
            runs[watched].append({"rc": done.returncode, "stdout_lines": len(lines), "out": out,
                                  "stderr_tail": done.stderr[-1500:]})
    result["launches"] = jsonable(runs)
    ok = all(r["rc"] == 0 and r["stdout_lines"] == 1 and r["out"] for rs in runs.values() for r in rs)
    report.check("run.job_exits_0_printing_only_its_own_line", ok,
                 {w: [(r["rc"], r["stdout_lines"]) for r in rs] for w, rs in runs.items()})
    if not ok:
        return
    losses = {w: {r["out"]["loss"] for r in rs} for w, rs in runs.items()}
    report.check("run.same_loss_with_and_without", losses[False] == losses[True], losses)
    report.check("run.one_line_on_stderr_says_watching",
                 all("gpumon" in r["stderr_tail"] and "watch" in r["stderr_tail"] for r in runs[True]),
                 [r["stderr_tail"][-300:] for r in runs[True]])
    ratios = [w["out"]["steps_per_s"] / b["out"]["steps_per_s"]
              for w, b in zip(runs[True], runs[False], strict=True)]
    result["throughput_ratios"] = ratios
    report.check("run.throughput_ratio_vs_bare (target >= 0.99; separate launches, info)", None,
                 {"median": statistics.median(ratios), "pairs": ratios,
                  "bare_steps_per_s": [r["out"]["steps_per_s"] for r in runs[False]]})
    time.sleep(2.5)  # the agent writes what it received to the recording
    lines = [r for r in read_recording(report.out / "recording.jsonl")
             if r.get("kind") == "step" and r.get("run") == RUN]
    report.check("run.one_step_per_optimizer_step", len(lines) == steps * pairs,
                 {"recorded": len(lines), "optimizer_steps": steps * pairs})
    phased = [r for r in lines
              if all(r.get("phases", {}).get(p, 0) > 0 for p in ("forward", "backward", "optimizer"))]
    report.check("run.phases_found_by_the_hooks", bool(lines) and len(phased) >= len(lines) - pairs,
                 {"with_all_three": len(phased), "steps": len(lines),
                  "example": lines[-1].get("phases") if lines else None})
    report.check("run.samples_from_the_dataloader",
                 bool(lines) and all(r.get("samples") == (64 if cuda else 8) for r in lines),
                 sorted({r.get("samples") for r in lines}, key=str))
    result["dev_phases"] = sorted({p for r in lines for p in r.get("dev", [])})
    section_hooks_in_c(report, result, env)


HOOK_PROBE = ("import torch, torch.utils.data.dataloader as d; "
              "print(type(torch.autograd.backward).__name__, "
              "type(d._BaseDataLoaderIter.__dict__['__next__']).__name__)")


def section_hooks_in_c(report: Report, result: dict[str, Any], env: dict[str, str]) -> None:
    """Which hooks a process ``gpumon run`` started has: C objects where the C core was built."""
    from gpumon.client.monitor import IMPLEMENTATION

    done = subprocess.run([sys.executable, "-m", "gpumon.cli", "run", "--run", RUN, "--",
                           sys.executable, "-c", HOOK_PROBE],
                          env=env, capture_output=True, text=True, timeout=120)
    kinds = done.stdout.split()
    result["hook_kinds"] = kinds
    expected = ["Hooked", "Hooked"] if IMPLEMENTATION == "c" else ["function", "function"]
    report.check("run.hooks_are_the_cores_own", done.returncode == 0 and kinds == expected,
                 {"core": IMPLEMENTATION, "hooks": kinds, "expected": expected,
                  "stderr_tail": done.stderr[-500:]})
