"""Where a run's time went, on a GPU: checkpoints of CUDA state recognised with no code change
and without synchronising the device (docs/goodput.md), which CPU tests cannot reach.

1. What the checkpoint taps add to a save: sizing a CUDA model's and optimizer's state (the
   test that tells a checkpoint from a metrics file) under torch's CUDA sync debug mode set to
   ``error``: reading sizes must not wait on the GPU.
2. A training loop on the device through ``mon.step()``, saving with ``torch.save`` and with
   ``torch.distributed.checkpoint.async_save`` (a world of one), then closing cleanly: the
   agent's ``gpumon_checkpoints_total{kind="save",result="ok"}`` counts both saves,
   ``gpumon_badput_seconds_total{cause="checkpoint"}`` is at most the time the job measured
   around its save calls, and once the run finished nothing is unsaved.

On a CPU (dry run) both parts run without the mode (it is CUDA's).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from gpumon.testing import AgentProcess, parse_metrics

from .report import Report

GOODPUT_RUN = "gpu-node-check-goodput"


def section_goodput(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess,
                    device: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gpumon.client import StepMonitor
    from gpumon.client.watchers.checkpoints import MIN_CHECKPOINT_BYTES, tensor_bytes

    cuda = device == "cuda"
    width = 2048 if cuda else 512
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, width, device=device)
    model(x).square().mean().backward()
    optimizer.step()

    # 1. Sizing CUDA state: no synchronisation.
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    try:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        nbytes, has_optimizer = tensor_bytes(state)
        report.check("goodput.sizing_no_sync", True, f"{nbytes} bytes sized")
    except RuntimeError as exc:
        report.check("goodput.sizing_no_sync", False, f"synchronised: {exc}")
        raise
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    report.check("goodput.a_checkpoint", nbytes >= MIN_CHECKPOINT_BYTES and has_optimizer,
                 {"bytes": nbytes, "optimizer_state": has_optimizer})

    # 2. A loop that saves twice, then finishes.
    scratch = Path(tempfile.mkdtemp(prefix="gpumon-goodput-"))
    steps = 10 if report.quick else 40
    mon = StepMonitor(run=GOODPUT_RUN, socket_path=str(agent.socket_path), rank=0, world=1)
    own_save_s = 0.0
    started_group = False
    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{scratch / 'store'}", rank=0,
                                    world_size=1)
            started_group = True
        pending = None
        for step in range(1, steps + 1):
            with mon.step():
                optimizer.zero_grad()
                model(x).square().mean().backward()
                optimizer.step()
            if step == steps // 2:
                began = time.perf_counter()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                           scratch / "checkpoint.pt")
                own_save_s += time.perf_counter() - began
            if step == steps:
                began = time.perf_counter()
                pending = dcp.async_save({"model": model.state_dict()},
                                         checkpoint_id=str(scratch / "dcp"))
                own_save_s += time.perf_counter() - began
        if pending is not None:
            getattr(pending, "upload_completion", pending).result()
    finally:
        mon.close()
        if started_group:
            dist.destroy_process_group()
    deadline = time.monotonic() + 10
    got: dict[str, float] = {}
    while time.monotonic() < deadline:
        metrics = parse_metrics(agent.scrape())
        got = {}
        for (name, labels), v in metrics.items():
            tags = dict(labels)
            if tags.get("run") != GOODPUT_RUN:
                continue
            if name == "gpumon_checkpoints_total" and tags["kind"] == "save" and tags["result"] == "ok":
                got["saves"] = v
            elif name == "gpumon_badput_seconds_total" and tags["cause"] == "checkpoint":
                got["checkpoint_s"] = v
            elif name in ("gpumon_unsaved_seconds", "gpumon_goodput_seconds_total"):
                got[name] = v
        if got.get("saves") == 2 and got.get("gpumon_unsaved_seconds") == 0.0:
            break
        time.sleep(0.5)
    result.update(agent=got, job_save_call_s=own_save_s, steps=steps)
    report.check("goodput.saves_counted", got.get("saves") == 2, got)
    report.check("goodput.checkpoint_time", 0 < got.get("checkpoint_s", 0) <= own_save_s * 1.05 + 0.01,
                 {"agent": got.get("checkpoint_s"), "job": own_save_s})
    report.check("goodput.finished_keeps_all", got.get("gpumon_unsaved_seconds") == 0.0
                 and got.get("gpumon_goodput_seconds_total", 0) > 0, got)
