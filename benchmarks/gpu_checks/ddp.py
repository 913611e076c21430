"""``watch()`` on a world-size-1 DDP job: one GPU is enough to run the communication
measurement's code path on NCCL (the DDP comm hook around the default all-reduce, the CUDA
events at each bucket's launch and completion and around DDP's wait at the end of backward,
resolved by the sender once the GPU has passed them), which CPU tests on gloo cannot reach.

``torch.distributed`` is initialised in this process (``MASTER_ADDR=127.0.0.1``, a free port,
``backend="nccl"`` on CUDA; gloo for a dry run without CUDA), a small MLP is wrapped in
``DistributedDataParallel`` and handed to ``mon.watch(ddp_model, optimizer)``, and steps run
through the hook against the agent. The checks read the agent's ``--record`` file: every step
after the first carries a ``comm`` field (exposed and busy seconds within the step, per-op
count, bytes and seconds), and the all-reduce bytes of a step equal the model's gradient bytes
(each gradient reduced once, even though ``watch`` was called twice). Then the throughput
of a watched DDP model against an identical one not watched, alternating blocks: at least
0.99 on the GPU. A gpumon without ``StepMonitor.watch`` makes the section "not available",
not an error.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpumon.testing import AgentProcess, free_port, parse_metrics

from .hook import read_recording
from .report import Report, SkipSection, jsonable

DDP_RUN = "gpu-node-check-ddp"


@contextmanager
def world_of_one_env() -> Iterator[None]:
    """The environment of rank 0 of a world of one over env:// on 127.0.0.1 (what
    ``init_process_group`` and ``deepspeed.init_distributed`` read), restored on exit so that
    later sections see the environment they had."""
    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextmanager
def process_group(torch: Any, backend: str) -> Iterator[None]:
    """A world-size-1 process group over env:// on 127.0.0.1, destroyed on exit."""
    with world_of_one_env():
        torch.distributed.init_process_group(backend, init_method="env://", rank=0, world_size=1,
                                             timeout=datetime.timedelta(seconds=60))
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


def gradient_bytes(model: Any) -> int:
    """Bytes of every gradient the model's backward produces: what DDP all-reduces per step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def section_ddp(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess,
                device: str) -> None:
    """Run the watched DDP job and check the ``comm`` field of its step records."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from gpumon.client import StepMonitor

    if not hasattr(StepMonitor, "watch"):
        report.check("ddp.watch_available", None, "StepMonitor has no watch() in this gpumon")
        raise SkipSection("not available: StepMonitor has no watch() in this gpumon")
    if not torch.distributed.is_available():
        raise SkipSection("not available: this torch has no torch.distributed")
    cuda = device == "cuda"
    backend = "nccl" if cuda else "gloo"
    if cuda and not torch.distributed.is_nccl_available():
        raise SkipSection("not available: this torch has no NCCL")
    width, layers, batch, steps = (2048, 4, 64, 40) if cuda else (256, 2, 16, 12)
    result.update(backend=backend, device=device, width=width, layers=layers, steps=steps)
    with process_group(torch, backend):
        torch.manual_seed(0)
        model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width),
                                                                    nn.ReLU()))).to(device)
        ddp = DistributedDataParallel(model, device_ids=[0] if cuda else None)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        grad_bytes = gradient_bytes(model)
        result["gradient_bytes"] = grad_bytes
        mon = StepMonitor(DDP_RUN, socket_path=str(agent.socket_path))
        try:
            watched = mon.watch(ddp, optimizer)
            again = mon.watch(ddp, optimizer)
            report.check("ddp.watch_returns_the_model", watched is ddp and again is ddp,
                         {"first": type(watched).__name__, "second": type(again).__name__})
            x = torch.randn(batch, width, device=device)
            result["wall_s"] = steps / train(torch, mon, ddp, optimizer, x, steps)
            mon.flush()
        finally:
            mon.close()
        result["client_stats"] = jsonable(mon.stats)
        throughput(report, result, torch, agent, device)
        # On NCCL the comm figures come from CUDA events the sender resolves once the GPU has
        # passed them: none may have been given up on.
        report.check("ddp.gpu_timed_fields_resolved", getattr(mon.stats, "gpu_fields_missed", 0) == 0,
                     {"gpu_fields_missed": getattr(mon.stats, "gpu_fields_missed", None)})
    time.sleep(2.5)  # the agent writes what it received to the recording
    check_records(report, result, steps, grad_bytes)
    metrics = parse_metrics(agent.scrape(10.0))
    comm_series = sorted({name for name, labels in metrics
                          if dict(labels).get("run") == DDP_RUN
                          and ("comm" in name or "collective" in name or "busbw" in name)})
    report.check("ddp.comm_series_exported", None, comm_series)


def train(torch: Any, mon: Any, model: Any, optimizer: Any, x: Any, steps: int) -> float:
    """``steps`` training steps through ``mon``'s hook, phases and all; steps per second, the
    GPU's work included (synchronised at both ends on CUDA)."""
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        with mon.step(samples=x.shape[0]):
            with mon.phase("forward"):
                loss = model(x).square().mean()
            with mon.phase("backward"):
                loss.backward()
            with mon.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - t0)


def check_records(report: Report, result: dict[str, Any], steps: int, grad_bytes: int) -> None:
    """The recorded steps of the DDP run and their ``comm`` fields against the ground truth."""
    lines = [r for r in read_recording(report.out / "recording.jsonl")
             if r.get("kind") == "step" and r.get("run") == DDP_RUN]
    lines.sort(key=lambda r: r.get("step", 0))
    report.check("ddp.steps_recorded", len(lines) == steps, {"recorded": len(lines), "run": steps})
    later = lines[1:]  # the first step builds DDP's buckets; from the second on, every step
    with_comm = [r for r in later if isinstance(r.get("comm"), dict)]
    report.check("ddp.comm_field_on_every_step", bool(later) and len(with_comm) == len(later),
                 {"steps_after_first": len(later), "with_comm": len(with_comm),
                  "example": with_comm[-1]["comm"] if with_comm else None})
    if not with_comm:
        return
    bad_times = [r["step"] for r in with_comm
                 if not (0 <= r["comm"].get("exposed", -1) <= r["duration"]
                         and 0 <= r["comm"].get("busy", -1) <= r["duration"])]
    report.check("ddp.comm_times_within_the_step", not bad_times, {"steps": bad_times[:10]})
    reduce_ops = [r["comm"].get("ops", {}).get("all_reduce") for r in with_comm]
    counts = [op[0] for op in reduce_ops if op]
    moved = [op[1] for op in reduce_ops if op]
    report.check("ddp.all_reduce_bytes_are_the_gradient_bytes",
                 len(moved) == len(with_comm) and all(b == grad_bytes for b in moved),
                 {"gradient_bytes": grad_bytes, "all_reduce_bytes": sorted(set(moved))[:5],
                  "steps_without_all_reduce": len(with_comm) - len(moved)})
    exposed = [r["comm"]["exposed"] / r["duration"] for r in with_comm if r.get("duration")]
    busy = [r["comm"]["busy"] / r["duration"] for r in with_comm if r.get("duration")]
    result["comm"] = {
        "all_reduce_per_step": sorted(set(counts)),
        "median_exposed_share": statistics.median(exposed) if exposed else None,
        "median_busy_share": statistics.median(busy) if busy else None,
        "median_step_s": statistics.median(r["duration"] for r in with_comm),
    }
    report.check("ddp.comm_figures", None, result["comm"])


AB_RUN = "gpu-node-check-ddp-ab"
AB_TARGET = 0.99
"""Throughput with ``watch()`` against without, on the GPU (issue target; on CPU gloo the
extra pass over the gradients a comm hook costs is most of a memory-bound step)."""


def throughput(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess,
               device: str) -> None:
    """Two identical DDP models, one watched, both stepped through the same monitor (so the
    hook's own cost is on both): blocks of steps alternate between them, the order flipping
    every round, and the figure is the median over rounds of watched ÷ plain throughput."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from gpumon.client import StepMonitor

    cuda = device == "cuda"
    width, layers, batch, rounds, block = (4096, 4, 2048, 10, 8) if cuda else (256, 2, 16, 3, 3)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width),
                                                                    nn.ReLU()))).to(device)
        ddp_model = DistributedDataParallel(model, device_ids=[0] if cuda else None)
        models.append((ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=1e-4)))
    mon = StepMonitor(AB_RUN, socket_path=str(agent.socket_path))
    x = torch.randn(batch, width, device=device)

    def run_block(ddp_model: Any, optimizer: Any) -> float:
        return train(torch, mon, ddp_model, optimizer, x, block)

    try:
        mon.watch(models[1][0], models[1][1])
        for pair in models:  # warm-up: buckets built, kernels chosen
            run_block(*pair)
        ratios = []
        for i in range(rounds):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            rate = {k: run_block(*models[k]) for k in order}
            ratios.append(rate[1] / rate[0])
    finally:
        mon.close()
    ratio = statistics.median(ratios)
    result["throughput"] = {"watched_over_plain": ratio, "rounds": [round(r, 4) for r in ratios],
                            "width": width, "batch": batch, "block_steps": block}
    report.check("ddp.watch_throughput_ratio", ratio >= AB_TARGET if cuda else None,
                 result["throughput"])
