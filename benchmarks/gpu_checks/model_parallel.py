"""Model parallelism's communication on the GPU: the functional collectives DTensor issues and
the point-to-point transfers of a pipeline, timed by CUDA events (NCCL), which CPU tests on
gloo cannot reach.

1. ``functional`` (one GPU is enough): a world-size-1 NCCL process group; each step launches
   ``funcol.all_reduce`` and ``funcol.all_gather_tensor`` on CUDA tensors between matmuls and
   uses their results (``wait_tensor``). The recorded steps must carry ``comm`` with those
   collectives counted and sized, every GPU-timed field resolved (none given up on), and the
   CPU cost per functional call with and without the tap.
2. ``p2p`` (two GPUs or more): two processes, a stage each, rank 0 sending 16 MiB to rank 1
   with ``isend`` after 20 ms of matmuls, rank 1 receiving with ``irecv`` and ``Work.wait()``:
   rank 1's steps must carry ``recv`` and a ``bubble`` between 0 and its exposed time; rank 0's
   ``send``. On one GPU it is "not available" (NCCL takes one rank per device); a dry run
   without CUDA runs it on gloo.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from gpumon.testing import AgentProcess, free_port

from .ddp import process_group
from .hook import read_recording
from .report import Report, SkipSection, jsonable

FUNCOL_RUN = "gpu-node-check-funcol"
P2P_RUN = "gpu-node-check-p2p"


def section_functional(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess,
                       device: str) -> None:
    from torch.distributed import _functional_collectives as funcol

    from gpumon.client import StepMonitor
    from gpumon.client.comm.tap import tap_into
    from gpumon.client.watchers.watch import comm_ledger

    cuda = device == "cuda"
    backend = "nccl" if cuda else "gloo"
    width, steps = (4096, 30) if cuda else (256, 8)
    result.update(backend=backend, width=width, steps=steps)
    with process_group(torch, backend):
        group = torch.distributed.group.WORLD
        mon = StepMonitor(FUNCOL_RUN, socket_path=str(agent.socket_path))
        try:
            report.check("functional.tapped", tap_into(comm_ledger(mon)), None)
            x = torch.randn(width, width, device=device)
            for _ in range(steps):
                with mon.step():
                    y = x @ x
                    reduced = funcol.all_reduce(y, "sum", group)
                    z = x @ x  # overlaps the all-reduce on the GPU
                    gathered = funcol.all_gather_tensor(reduced + z, 0, group)
                    float(gathered.sum())
            mon.flush()
            if cuda:
                torch.cuda.synchronize()
            result["per_call_us"] = _call_cost(torch, funcol, group, device)
        finally:
            mon.close()
        result["client_stats"] = jsonable(mon.stats)
        report.check("functional.gpu_timed_fields_resolved",
                     getattr(mon.stats, "gpu_fields_missed", 0) == 0,
                     {"gpu_fields_missed": getattr(mon.stats, "gpu_fields_missed", None)})
    time.sleep(2.5)  # the agent writes what it received to the recording
    lines = [r for r in read_recording(report.out / "recording.jsonl")
             if r.get("kind") == "step" and r.get("run") == FUNCOL_RUN]
    with_comm = [r for r in lines[1:] if isinstance(r.get("comm"), dict)]
    report.check("functional.comm_on_every_step", bool(with_comm) and len(with_comm) == len(lines) - 1,
                 {"steps": len(lines), "with_comm": len(with_comm),
                  "example": with_comm[-1]["comm"] if with_comm else None})
    size = width * width * 4
    ops = [r["comm"].get("ops", {}) for r in with_comm]
    report.check("functional.counted_and_sized",
                 bool(ops) and all(o.get("all_reduce", [0, 0])[:2] == [1, size]
                                   and o.get("all_gather", [0, 0])[:2] == [1, size]
                                   for o in ops),
                 {"expected_bytes": size, "first": ops[0] if ops else None})


def _call_cost(torch: Any, funcol: Any, group: Any, device: str) -> dict[str, float]:
    """µs of CPU per functional all-reduce + wait on a small tensor, tapped (a ledger watching,
    as above) — the figure to hold against the collective tap's in RESULTS."""
    x = torch.ones(1024, device=device)
    calls = 2000
    for _ in range(100):
        funcol.all_reduce(x, "sum", group).wait()
    start = time.process_time()
    for _ in range(calls):
        funcol.all_reduce(x, "sum", group).wait()
    return {"tapped_cpu_us_per_call": (time.process_time() - start) / calls * 1e6}


_P2P_CHILD = r"""
import json, os, sys, time, torch, torch.distributed as dist
from gpumon.client import StepMonitor
from gpumon.client.comm.tap import tap_into
from gpumon.client.watchers.watch import comm_ledger
cuda = sys.argv[1] == "cuda"
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = f"cuda:{rank}" if cuda else "cpu"
if cuda:
    torch.cuda.set_device(rank)
mon = StepMonitor(os.environ["P2P_RUN"], socket_path=os.environ["P2P_SOCKET"])
assert tap_into(comm_ledger(mon))
buffer = torch.ones(4 * 1024 * 1024, device=device)  # 16 MiB
a = torch.randn(2048 if cuda else 128, 2048 if cuda else 128, device=device)
for _ in range(int(sys.argv[2])):
    with mon.step():
        if rank == 0:
            end = time.perf_counter() + 0.02
            while time.perf_counter() < end:
                a = a @ a / a.norm()
            dist.isend(buffer, 1).wait()
        else:
            dist.irecv(buffer, 0).wait()
            float(buffer[0])
mon.close()
dist.barrier()
dist.destroy_process_group()
"""


def section_p2p(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess,
                device: str) -> None:
    cuda = device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise SkipSection("not available: one GPU (NCCL takes one rank per device)")
    steps = 20 if cuda else 6
    script = report.out / "p2p_child.py"
    script.write_text(_P2P_CHILD)
    env = {**os.environ, "P2P_RUN": P2P_RUN, "P2P_SOCKET": str(agent.socket_path),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script),
                           "cuda" if cuda else "cpu", str(steps)],
                          capture_output=True, text=True, timeout=180, env=env)
    report.check("p2p.job_ran", done.returncode == 0, done.stderr[-2000:])
    time.sleep(2.5)
    lines = [r for r in read_recording(report.out / "recording.jsonl")
             if r.get("kind") == "step" and r.get("run") == P2P_RUN]
    receiver = [r for r in lines if r.get("rank") == 1 and isinstance(r.get("comm"), dict)]
    sender = [r for r in lines if r.get("rank") == 0 and isinstance(r.get("comm"), dict)]
    report.check("p2p.receives_counted_with_a_bubble",
                 bool(receiver) and all("recv" in r["comm"].get("ops", {})
                                        and 0 <= r["comm"].get("bubble", -1)
                                        <= r["comm"]["exposed"] + 1e-9 for r in receiver),
                 {"steps": len(receiver), "example": receiver[-1]["comm"] if receiver else None})
    report.check("p2p.sends_counted", bool(sender) and all(
        r["comm"]["ops"].get("send", [0])[0] >= 1 for r in sender), {"steps": len(sender)})
    if receiver:
        result["median_bubble_share"] = sorted(
            r["comm"]["bubble"] / r["duration"] for r in receiver)[len(receiver) // 2]
