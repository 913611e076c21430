"""A profiler trace of a watched world-size-1 DDP job (NCCL on CUDA; gloo in a dry run), asked
of the running agent through its HTTP API as ``gpumon trace`` asks, and read back.

The checks: the trace is written (and brought back as ``trace_rank0.pt.trace.json.gz``), its
gpumon phase ranges summed per step agree with the phase seconds the agent recorded for the
same steps (within ``PHASE_BOUND_S``), and, where Holistic Trace Analysis is installed, it loads.
On CUDA, HTA's temporal breakdown (the GPU's idle, compute and non-compute time) and its
communication/computation overlap are set beside gpumon's figures for the same steps: the
share of the collectives' in-flight time that overlapped compute, ``(busy - exposed) / busy``
of the recorded ``comm``, within ``OVERLAP_BOUND`` of HTA's overlap, and the traced steps'
GPU-timed share. Without CUDA, HTA's GPU analyses have no kernels to read: informational.
"""

from __future__ import annotations

import gzip
import json
import shutil
import statistics
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from gpumon.testing import AgentProcess

from .ddp import process_group
from .hook import read_recording
from .report import Report, SkipSection, jsonable

TRACE_RUN = "gpu-node-check-trace"
TRACE_STEPS = 5
PHASE_BOUND_S = 2e-6
"""A traced step's host-timed phases: the core times them from the very readings the ranges
are drawn from, so what differs is the trace's rounding to the nanosecond, summed."""
OVERLAP_BOUND = 0.25
"""HTA's overlap counts kernels on the GPU's timeline; gpumon's comes from the CUDA events at
each bucket's launch and completion and DDP's wait: the same intervals seen from two ends."""


def section_trace(report: Report, result: dict[str, Any], torch: Any, agent: AgentProcess,
                  device: str) -> None:
    """Train, ask the agent for a trace, compare it with the recording and with HTA."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from gpumon.client import StepMonitor

    cuda = device == "cuda"
    if not torch.distributed.is_available():
        raise SkipSection("not available: this torch has no torch.distributed")
    width, layers, batch = (2048, 4, 64) if cuda else (256, 2, 16)
    with process_group(torch, "nccl" if cuda else "gloo"):
        torch.manual_seed(0)
        model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width),
                                                                    nn.ReLU()))).to(device)
        ddp = DistributedDataParallel(model, device_ids=[0] if cuda else None)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        mon = StepMonitor(TRACE_RUN, socket_path=str(agent.socket_path))
        x = torch.randn(batch, width, device=device)
        try:
            mon.watch(ddp, optimizer)
            steps(torch, mon, ddp, optimizer, x, 20)
            mon.flush()
            time.sleep(1.0)  # the agent has heard of the rank
            asked = post(agent.url, {"run": TRACE_RUN, "rank": 0, "steps": TRACE_STEPS})
            report.check("trace.request_taken", asked[0] == 202, asked)
            if asked[0] != 202:
                return
            ident = asked[1]["traces"][0]["id"]
            deadline = time.monotonic() + 60
            trace: dict[str, Any] = {}
            while time.monotonic() < deadline:
                steps(torch, mon, ddp, optimizer, x, 5)
                trace = get(f"{agent.url}/api/v1/traces/{ident}")
                if trace.get("state") in ("done", "failed"):
                    break
            steps(torch, mon, ddp, optimizer, x, 10)
            mon.flush()
        finally:
            mon.close()
    result["trace"] = trace
    report.check("trace.written", trace.get("state") == "done", trace)
    if trace.get("state") != "done":
        return
    path = Path(trace["path"])
    kept = report.out / "trace_rank0.pt.trace.json.gz"
    shutil.copyfile(path, kept)
    time.sleep(2.5)  # the agent writes what it received to the recording
    with gzip.open(kept) as f:
        document = json.load(f)
    recorded = {r["step"]: r for r in read_recording(report.out / "recording.jsonl")
                if r.get("kind") == "step" and r.get("run") == TRACE_RUN}
    sums = phase_sums(document)
    # Phases the record times on the GPU (its "dev") are kernel time, not the host's range:
    # set beside the range, not held to it.
    worst: dict[int, float] = {}
    compared = 0
    device: dict[int, dict[str, list[float]]] = {}
    for step, phases in sums.items():
        if step not in recorded:
            continue
        record = recorded[step]
        on_gpu = set(record.get("dev") or ())
        worst[step] = max((abs(seconds - record["phases"].get(name, 0.0))
                           for name, seconds in phases.items() if name not in on_gpu), default=0.0)
        compared += sum(name not in on_gpu for name in phases)
        device[step] = {name: [seconds, record["phases"].get(name, 0.0)]
                        for name, seconds in phases.items() if name in on_gpu}
    worst_step = max(worst, key=worst.__getitem__, default=None)
    # Every phase timed on the GPU (CUDA, where a trace times every step there): nothing
    # host-timed to hold to its range, and the check says so rather than pass.
    report.check("trace.phase_ranges_match_records",
                 (len(worst) == TRACE_STEPS and max(worst.values()) <= PHASE_BOUND_S)
                 if compared or not worst else None,
                 {"steps": sorted(worst), "worst_s": max(worst.values(), default=None),
                  "bound_s": PHASE_BOUND_S,
                  "worst_step": None if worst_step is None else {
                      "ranges_s": sums[worst_step], "recorded_s": recorded[worst_step]["phases"]}})
    result["trace_device_phases_range_vs_gpu_s"] = device
    traced = [recorded[s] for s in sorted(worst)]
    hta(report, result, kept, traced, cuda)


def steps(torch: Any, mon: Any, model: Any, optimizer: Any, x: Any, n: int) -> None:
    for _ in range(n):
        with mon.step(samples=x.shape[0]):
            with mon.phase("forward"):
                loss = model(x).square().mean()
            with mon.phase("backward"):
                loss.backward()
            with mon.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    if x.device.type == "cuda":
        torch.cuda.synchronize()


def phase_sums(document: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per traced step (its recorded number), the seconds of each gpumon phase range in it."""
    events = [e for e in document["traceEvents"] if e.get("ph") == "X"]
    records = [e for e in events if e["name"] == "gpumon.record"]
    out: dict[int, dict[str, float]] = {}
    for record in records:
        t0, t1 = record["ts"], record["ts"] + record["dur"]
        phases: dict[str, float] = defaultdict(float)
        for e in events:
            # A range belongs to the step its middle lies in: the last phase of one step may
            # end within a microsecond of the next record's window opening.
            if e.get("cat") == "gpumon" and "phase" in e.get("args", {}) and \
                    t0 <= e["ts"] + e["dur"] / 2 < t1:
                phases[e["args"]["phase"]] += e["dur"] / 1e6
        out[record["args"]["step"]] = dict(phases)
    return out


def hta(report: Report, result: dict[str, Any], path: Path, traced: list[dict[str, Any]],
        cuda: bool) -> None:
    """HTA loads the trace; on CUDA its breakdown and overlap beside gpumon's figures."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError as exc:
        report.check("trace.hta_loads", None, f"HTA not installed: {exc}")
        return
    with tempfile.TemporaryDirectory() as directory:
        shutil.copyfile(path, Path(directory) / path.name)
        analysis = TraceAnalysis(trace_dir=directory)
        report.check("trace.hta_loads", analysis.t.get_ranks() == [0], analysis.t.get_ranks())
        comm = [r["comm"] for r in traced if isinstance(r.get("comm"), dict) and r["comm"].get("busy")]
        shares = [(c["busy"] - c["exposed"]) / c["busy"] for c in comm]
        gpumon_overlap = statistics.median(shares) if shares else None
        result["gpumon"] = {"overlap_share": gpumon_overlap,
                            "device_phases": [r.get("dev") for r in traced],
                            "phases": [r.get("phases") for r in traced]}
        if not cuda:
            report.check("trace.hta_gpu_analyses", None, "no CUDA: no kernels for HTA to read")
            return
        breakdown = analysis.get_temporal_breakdown(visualize=False)
        overlap = analysis.get_comm_comp_overlap(visualize=False)
        result["hta"] = {"temporal_breakdown": jsonable(breakdown.to_dict("records")),
                         "comm_comp_overlap": jsonable(overlap.to_dict("records"))}
        hta_overlap = float(overlap.iloc[0]["comp_comm_overlap_pctg"]) / 100
        report.check("trace.hta_temporal_breakdown", None, result["hta"]["temporal_breakdown"])
        report.check("trace.overlap_hta_vs_gpumon",
                     gpumon_overlap is not None and abs(hta_overlap - gpumon_overlap) <= OVERLAP_BOUND,
                     {"hta": hta_overlap, "gpumon": gpumon_overlap, "bound": OVERLAP_BOUND})


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"{url}/api/v1/traces", data=json.dumps(body).encode(),
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        document: dict[str, Any] = json.loads(response.read())
    return document
