"""``watch(engine)`` on a world-size-1 DeepSpeed job: one GPU runs ZeRO through NCCL and the
CUDA accelerator, which CPU tests on gloo cannot reach.

``torch.distributed`` is initialised through ``deepspeed.init_distributed`` in this process
(``MASTER_ADDR=127.0.0.1``, a free port, NCCL on CUDA; gloo with DeepSpeed's CPU accelerator for
a dry run without CUDA), a small MLP goes through ``deepspeed.initialize`` at ZeRO stage 2 with
a torch AdamW, and ``mon.watch(engine)`` is the only gpumon call: the loop writes no
``mon.step``. The checks read the agent's ``--record`` file: one step per optimizer step, each
with the engine's forward, backward and optimizer phases and its samples; a memory breakdown
on a sampled step whose optimizer states hold the fp32 master copy; the rank's framework and
ZeRO stage exported. Whether a step carries ``comm`` is reported, not checked: ZeRO-2's
reductions are blocking calls on NCCL, which no CUDA event brackets, so those steps carry none
(docs/deepspeed.md). A machine without DeepSpeed makes the section "not available".
"""

from __future__ import annotations

import os
import time
from typing import Any

from gpumon.testing import AgentProcess, parse_metrics

from .ddp import world_of_one_env
from .hook import read_recording
from .report import Report, SkipSection, jsonable

DS_RUN = "gpu-node-check-deepspeed"
STAGE = 2
GAS = 2


def section_deepspeed(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess,
                      device: str) -> None:
    """Train a watched DeepSpeed engine and check what the agent recorded of it."""
    cuda = device == "cuda"
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        raise SkipSection(f"not available: deepspeed does not import ({exc})") from None
    from torch import nn

    from gpumon.client import StepMonitor

    width, batch, steps = (2048, 64, 20) if cuda else (128, 8, 6)
    result.update(device=device, deepspeed=deepspeed.__version__, stage=STAGE, gas=GAS,
                  width=width, steps=steps)
    if not cuda:
        # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (a C++ op) on first
        # use; a world of one never calls it, and the dry run has no time to build it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    with world_of_one_env():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        try:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).to(device)
            config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": GAS,
                      "zero_optimization": {"stage": STAGE}, "zero_allow_untested_optimizer": True}
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
            mon = StepMonitor(DS_RUN, socket_path=str(agent.socket_path))
            try:
                mon.watch(engine)
                x = torch.randn(batch, width, device=device)
                t0 = time.perf_counter()
                for _ in range(steps * GAS):
                    engine.backward(engine(x).square().mean())
                    engine.step()
                if cuda:
                    torch.cuda.synchronize()
                result["steps_per_s"] = steps / (time.perf_counter() - t0)
                mon.flush()
            finally:
                mon.close()
            result["client_stats"] = jsonable(mon.stats)
            result["params"] = sum(p.numel() for p in model.parameters())
        finally:
            torch.distributed.destroy_process_group()
    time.sleep(2.5)  # the agent writes what it received to the recording
    check_records(report, result, steps, batch)
    metrics = parse_metrics(agent.scrape(10.0))
    info = [dict(labels) for name, labels in metrics
            if name == "gpumon_rank_framework_info" and dict(labels).get("run") == DS_RUN]
    report.check("deepspeed.framework_exported",
                 [(i.get("framework"), i.get("zero_stage")) for i in info] == [("deepspeed", str(STAGE))],
                 info)


def check_records(report: Report, result: dict[str, Any], steps: int, batch: int) -> None:
    """The recorded steps of the run: one per optimizer step, phases, samples, breakdown."""
    lines = sorted((r for r in read_recording(report.out / "recording.jsonl")
                    if r.get("kind") == "step" and r.get("run") == DS_RUN),
                   key=lambda r: r.get("step", 0))
    report.check("deepspeed.one_step_per_optimizer_step", len(lines) == steps,
                 {"recorded": len(lines), "optimizer_steps": steps})
    phased = [r for r in lines
              if all(r.get("phases", {}).get(p, 0) > 0 for p in ("forward", "backward", "optimizer"))]
    report.check("deepspeed.phases_from_the_engine", bool(lines) and len(phased) == len(lines),
                 {"with_all_three": len(phased), "example": lines[-1].get("phases") if lines else None})
    report.check("deepspeed.samples_summed_over_micro_batches",
                 bool(lines) and all(r.get("samples") == GAS * batch for r in lines),
                 sorted({r.get("samples") for r in lines}, key=str))
    breakdowns = [r["memb"] for r in lines if isinstance(r.get("memb"), dict)]
    params = result.get("params", 0)
    # ZeRO-2 on one rank: AdamW's two moments and the fp32 master copy, 12 bytes a parameter.
    report.check("deepspeed.optimizer_states_hold_the_master_copy",
                 bool(breakdowns) and breakdowns[0].get("optimizer_states", 0) >= 12 * params * 0.97,
                 {"breakdown": breakdowns[0] if breakdowns else None, "params": params})
    with_comm = [r for r in lines if isinstance(r.get("comm"), dict)]
    report.check("deepspeed.steps_with_comm", None,
                 {"with_comm": len(with_comm), "steps": len(lines),
                  "example": with_comm[-1]["comm"] if with_comm else None})
