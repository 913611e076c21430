"""One-shot check of gpumon on a real GPU node: NVML support, the agent, the CUDA hook, overhead.

    PYTHONPATH=. python3 benchmarks/gpu_node_check.py --out DIR [--budget-s 270] [--nvml auto]

Written to be run once on a GPU node with no network and little time to spare, and to bring
back everything worth knowing from that run, in a few files under ``--out``:

    summary.json               every result, check and traceback (rewritten after each section)
    summary.md                 the same, readable
    nvidia-smi.txt             ``nvidia-smi -q``
    metrics_mid_training.txt   /metrics while the CUDA training loop runs (GPU gauges busy)
    metrics_after_training.txt /metrics once the agent has analysed the steps
    metrics_oom.txt            /metrics at the highest OOM risk of the memory-pressure test
    metrics_owners.txt         /metrics once the agent has worked out whose the training process is
    recording.jsonl.gz         the agent's ``--record`` of every step and GPU sample
    trace_rank0.pt.trace.json.gz  the trace section's profiler trace
    agent.log                  the agent's log
    (and what the memory-breakdown section writes, where it exists)

Sections, one module each in ``benchmarks/gpu_checks/`` (each timed and wrapped: a failure is
recorded with its traceback and the next section still runs; a watchdog ends the whole script
before ``--budget-s``):

1. environment: nvidia-smi, driver/CUDA, Python packages, torch and its device.
2. nvml: in a child process (``nvml_probe``), gpumon's own NvmlSource on the real library,
   every raw NVML call gpumon relies on, the GPM metrics one by one, ``gpumon doctor``, and
   the CPU cost of one collection cycle against the bare pynvml calls.
3. agent + training (``agent``, ``hook``): ``gpumon agent`` on a free port with its socket in
   a temp dir, a bf16 transformer trained on the GPU through ``StepMonitor``, /metrics while
   it runs and after: steps, verdicts, CUDA-event phase times, torch memory, the rank's GPU.
   Then (``owners``) whose that process is: ``gpumon_rank_info``'s node and user for its rank,
   ``gpumon_gpu_owner_info`` for the GPU it holds, and its own cgroup as the parser reads it.
4. overhead (``hook``): blocks with and without the hook, alternating, for the GPU-bound
   transformer and a launch-bound small MLP.
5. oom (``oom``): memory held up to ~85 % of the device with steps running, then freed (the
   risk must come back down), then a *raised* torch.OutOfMemoryError through the hook's step.
6. ddp (``ddp``): a world-size-1 NCCL DDP job through ``mon.watch(model, optimizer)``; its
   step records must carry the measured ``comm`` field ("not available" before ``watch``).
6a. model parallelism (``model_parallel``): functional collectives (DTensor's path) on a
   world-size-1 NCCL group, timed by CUDA events, counted and sized; point-to-point
   ``isend``/``irecv`` between two GPUs with the receiver's bubble (two GPUs or more).
6b. deepspeed (``deepspeed``): a world-size-1 DeepSpeed job (ZeRO-2, NCCL) through
   ``mon.watch(engine)`` alone: one step per optimizer step with the engine's phases, ZeRO's
   memory breakdown, the framework and stage exported ("not available" without DeepSpeed).
6c. moe (``moe``): each MoE layer's expert load counted on the GPU with no synchronisation
   (torch's CUDA sync debug mode set to ``error`` around the hook, the step's end, and whole
   steps of a layer that synchronises nothing reported through ``mon.expert_load``), the
   counts arriving in the agent's /metrics as the job counted them.
6d. goodput (``goodput``): checkpoints of CUDA state recognised without synchronising (the
   taps' sizing under sync debug mode ``error``), a ``torch.save`` and a DCP ``async_save``
   counted in ``gpumon_checkpoints_total``, their time in the checkpoint badput, nothing
   unsaved once the run finished.
7. memory (``memory``, where that module exists): the live memory breakdown against
   ``torch.cuda.memory_stats()``.
7a. trace (``trace``): a profiler trace of a watched DDP job asked of the agent
   (``/api/v1/traces``), its phase ranges against the recorded steps, HTA's temporal breakdown
   and communication/computation overlap beside gpumon's (CUDA only; HTA loads it either way).
7b. run (``run``): an unmodified CUDA script (``run_job.py``) bare and under ``gpumon run``:
   its output and loss unchanged, one step per optimizer step with the phases the hooks found,
   the throughput ratio (information: separate launches), and the hooks a process it started
   holds (the C core's ``Hooked`` objects where it was built).
8. stall (``stall``): a rank stuck behind a kernel, its NCCL all-reduce not passed on the GPU,
   told apart from one stuck on the host, as the agent reports them (the host case only in a
   dry run).
9. replay: ``gpumon classify`` over the recording.

Without CUDA (a dry run on a CPU machine) the NVML child loads the project's fake
libnvidia-ml (gpumon.testing.fakenvml, built with gcc) with an H200-like scenario, the training
runs a tiny model on the CPU, DDP and DeepSpeed run on gloo, and the CUDA-only checks are
informational.
``--quick`` shortens every loop for the test suite's dry run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpu_checks import agent as agent_checks  # noqa: E402
from gpu_checks import ddp, hook, model_parallel, nvml, oom, owners, stall  # noqa: E402
from gpu_checks import deepspeed as deepspeed_check  # noqa: E402
from gpu_checks import goodput as goodput_check  # noqa: E402
from gpu_checks import moe as moe_check  # noqa: E402
from gpu_checks import run as run_check  # noqa: E402
from gpu_checks import trace as trace_check  # noqa: E402
from gpu_checks.environment import section_environment  # noqa: E402
from gpu_checks.nvml_probe import nvml_child  # noqa: E402
from gpu_checks.report import Report, SkipSection, jsonable, now, tb  # noqa: E402

MEMORY_CHECK = "gpu_checks.memory"  # memory_breakdown_check(out_dir), where it exists


def memory_section(report: Report, result: dict[str, Any]) -> None:
    """The memory-breakdown check, if this tree has it; its own errors are the section's."""
    if importlib.util.find_spec(MEMORY_CHECK) is None:
        raise SkipSection(f"not available: no {MEMORY_CHECK} in this tree")
    check = importlib.import_module(MEMORY_CHECK).memory_breakdown_check
    found = check(report.out)
    if found is not None:
        result["result"] = jsonable(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="the watchdog ends the script after this many seconds")
    parser.add_argument("--nvml", choices=("auto", "real", "fake"), default="auto",
                        help="real libnvidia-ml, the project's fake one (dry run), or auto: "
                             "real when libnvidia-ml.so.1 loads")
    parser.add_argument("--quick", action="store_true",
                        help="short loops everywhere (the test suite's dry run); figures mean little")
    parser.add_argument("--nvml-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cycles", type=int, default=200, help=argparse.SUPPRESS)
    parser.add_argument("--child-limit", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.nvml_child:
        print(json.dumps(jsonable(nvml_child(args.cycles, args.child_limit, str(args.out)))),
              flush=True)
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, args.budget_s, markdown=[nvml.markdown, hook.markdown, oom.markdown,
                                                      stall.markdown],
                    quick=args.quick)
    report.start_watchdog()
    scratch = Path(tempfile.mkdtemp(prefix="gpumon-node-check-"))
    st: dict[str, Any] = {"torch": None, "env": {}, "agent": None, "work": None, "mon": None,
                          "device": "cpu"}

    def environment(r: dict[str, Any]) -> None:
        st["torch"] = torch = section_environment(report, r)
        st["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        if st["device"] == "cpu":
            torch.set_num_threads(min(4, os.cpu_count() or 1))

    def nvml_setup(r: dict[str, Any]) -> None:
        st["env"] = nvml.nvml_environment(args.nvml, scratch, report)
        r["mode"] = report.data["nvml_mode"]
        r["agent_imports_missing"] = agent_checks.add_import_shims(st["env"], scratch, report)

    def agent_start(r: dict[str, Any]) -> None:
        st["env"]["GPUMON_TRACE_DIR"] = str(scratch / "traces")  # the trace section's files
        st["agent"] = agent_checks.start(report, r, st["env"], scratch)

    def training(r: dict[str, Any]) -> None:
        if st["torch"] is None:
            raise SkipSection("torch did not import")
        if st["device"] == "cpu":
            r["note"] = "no CUDA: the loop ran on the CPU (dry run); CUDA checks are info only"
        st["work"], st["mon"] = hook.section_training(report, r, st["torch"], st["agent"],
                                                      st["device"])

    def overhead(r: dict[str, Any]) -> None:
        if st["mon"] is None:
            raise SkipSection("no monitor (the training section failed)")
        if st["device"] == "cpu":
            r["note"] = "no CUDA: CPU blocks (dry run), the ratios mean little"
        hook.section_overhead(report, r, st["torch"], st["device"], st["work"], st["mon"])

    def oom_pressure(r: dict[str, Any]) -> None:
        if st["device"] != "cuda":
            r["note"] = "no CUDA: a few MiB of host memory (dry run of the code path)"
        oom.section_oom(report, r, st["torch"], st["agent"], st["device"])

    def watched_ddp(r: dict[str, Any]) -> None:
        if st["torch"] is None:
            raise SkipSection("torch did not import")
        if st["device"] != "cuda":
            r["note"] = "no CUDA: DDP on gloo (dry run of the code path), not NCCL"
        ddp.section_ddp(report, r, st["torch"], st["agent"], st["device"])

    def functional(r: dict[str, Any]) -> None:
        if st["torch"] is None:
            raise SkipSection("torch did not import")
        if st["device"] != "cuda":
            r["note"] = "no CUDA: functional collectives on gloo (dry run of the code path)"
        model_parallel.section_functional(report, r, st["torch"], st["agent"], st["device"])

    def p2p(r: dict[str, Any]) -> None:
        if st["torch"] is None:
            raise SkipSection("torch did not import")
        if st["device"] != "cuda":
            r["note"] = "no CUDA: transfers on gloo between two processes (dry run)"
        model_parallel.section_p2p(report, r, st["torch"], st["agent"], st["device"])

    def watched_deepspeed(r: dict[str, Any]) -> None:
        if st["torch"] is None:
            raise SkipSection("torch did not import")
        if st["device"] != "cuda":
            r["note"] = "no CUDA: DeepSpeed's CPU accelerator on gloo (dry run of the code path), not NCCL"
        deepspeed_check.section_deepspeed(report, r, st["torch"], st["agent"], st["device"])

    def moe_load(r: dict[str, Any]) -> None:
        if st["torch"] is None:
            raise SkipSection("torch did not import")
        if st["device"] != "cuda":
            r["note"] = "no CUDA: the counts on the CPU, no sync debug mode (dry run of the code path)"
        moe_check.section_moe(report, r, st["torch"], st["agent"], st["device"])

    def goodput(r: dict[str, Any]) -> None:
        if st["torch"] is None:
            raise SkipSection("torch did not import")
        if st["device"] != "cuda":
            r["note"] = "no CUDA: CPU state, no sync debug mode (dry run of the code path)"
        goodput_check.section_goodput(report, r, st["torch"], st["agent"], st["device"])

    try:
        report.run("environment", environment)
        report.run("nvml_setup", nvml_setup)
        if st["env"]:
            report.run("nvml", lambda r: nvml.section_nvml(report, r, st["env"], scratch), need_s=30)
            report.run("agent_start", agent_start, need_s=60)
        agent = st["agent"]
        if agent is not None and agent.process.poll() is None:
            report.run("training", training, need_s=50)
            report.run("endpoints", lambda r: agent_checks.section_endpoints(report, r, agent))
            report.run("owners", lambda r: owners.section_owners(report, r, agent, st["device"]),
                       need_s=20)
            report.run("overhead", overhead, need_s=45)
            report.run("oom", oom_pressure, need_s=35)
            report.run("oom_event", lambda r: oom.section_oom_event(report, r, st["torch"], agent),
                       need_s=10)
            if st["mon"] is not None:
                st["mon"].close()
            report.run("ddp", watched_ddp, need_s=30)
            report.run("functional", functional, need_s=20)
            report.run("p2p", p2p, need_s=25)
            report.run("deepspeed", watched_deepspeed, need_s=25)
            report.run("moe", moe_load, need_s=20)
            report.run("goodput", goodput, need_s=20)
            report.run("memory", lambda r: memory_section(report, r), need_s=20)
            report.run("trace", lambda r: trace_check.section_trace(report, r, st["torch"], agent,
                                                                   st["device"]), need_s=30)
            report.run("run", lambda r: run_check.section_run(report, r, agent, st["device"]), need_s=40)
            report.run("stall", lambda r: stall.section_stall(report, r, agent, st["device"]),
                       need_s=45)
            report.run("replay", lambda r: agent_checks.section_replay(report, r, st["env"]),
                       need_s=10)
        else:
            report.data["aborted"] = "no running agent: training, overhead and OOM not run"
    finally:
        if st["agent"] is not None:
            report.run("agent_stop", lambda r: agent_checks.section_agent_stop(report, r, st["agent"]))
        shutil.rmtree(scratch, ignore_errors=True)
        report.write()
        try:
            report.write_markdown()
        except Exception:
            print(f"summary.md failed:\n{tb()}", flush=True)
    checks = report.data["checks"]
    failed = [n for n, c in checks.items() if c["ok"] is False]
    errors = [n for n, s in report.data["sections"].items() if s.get("status") == "error"]
    print(f"\nDONE in {now() - report.t0:.0f} s: {len(checks)} checks, "
          f"{sum(1 for c in checks.values() if c['ok'])} passed, {len(failed)} failed "
          f"{failed}; section errors {errors}; results in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
