"""The live memory breakdown on a real device, against the allocator and PyTorch's own categories.

A small transformer (two ``TransformerEncoderLayer``s and a head) trains with AdamW through the
public hook, watched (``mon.watch(model, optimizer)``), and the sampled breakdown of its step
records is compared with what PyTorch says about the same steps:

* ``torch.cuda.memory_stats()``: the breakdown's named parts and ``other`` against the
  reserved bytes, the named parts against the peak allocated bytes of the step;
* PyTorch's memory profiler (``torch.profiler`` with ``profile_memory=True``), which
  categorises every allocation offline — parameter, gradient, optimizer state, activation,
  temporary: its peak per category beside the breakdown's part of the same name.

Without CUDA (a dry run) the same runs on the CPU: the allocator comparison is skipped and
the profiler's categories still are compared. Writes ``memory_breakdown.json`` under
``out_dir`` and returns its content.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RATIO_KEYS = ("parameters", "gradients", "optimizer_states", "activations")
_PROFILER_NAMES = {"PARAMETER": "parameters", "GRADIENT": "gradients",
                   "OPTIMIZER_STATE": "optimizer_states", "ACTIVATION": "activations",
                   "TEMPORARY": "temporary", "INPUT": "input",
                   "AUTOGRAD_DETAIL": "autograd_detail"}


def memory_breakdown_check(out_dir: Path | str, steps: int = 6) -> dict[str, Any]:
    """Run the comparison; returns (and writes) what it found."""
    import torch
    from torch import nn

    from gpumon.client import StepMonitor
    from gpumon.client.core.transport import MemoryTransport
    from gpumon.wire import StepRecord

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    hidden, heads, seq, batch = (1024, 16, 512, 8) if cuda else (128, 4, 64, 4)
    model = nn.Sequential(
        nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=4 * hidden, batch_first=True),
        nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=4 * hidden, batch_first=True),
        nn.Linear(hidden, 1000)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    transport = MemoryTransport()
    os.environ["GPUMON_MEMORY_SAMPLE_S"] = "0"  # every step: the check compares each one
    try:
        mon = StepMonitor(run="gpu-node-check-memory", transport=transport, rank=0, world=1)
        mon.watch(model, opt)
    finally:
        os.environ.pop("GPUMON_MEMORY_SAMPLE_S", None)

    def step() -> None:
        x = torch.randn(batch, seq, hidden, device=device)
        y = torch.randint(0, 1000, (batch, seq), device=device)
        with mon.step(samples=batch):
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()

    allocator: list[dict[str, int]] = []
    for _ in range(steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step()
        if cuda:
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            allocator.append({k: int(stats.get(k, 0)) for k in (
                "allocated_bytes.all.current", "allocated_bytes.all.peak",
                "reserved_bytes.all.current", "inactive_split_bytes.all.current",
                "requested_bytes.all.peak")})
    profiler = _profiler_categories(torch, step, device.type)
    mon.close()
    breakdowns = [r.memory_breakdown for r in transport.records()
                  if isinstance(r, StepRecord) and r.memory_breakdown is not None]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
                              "shape": {"hidden": hidden, "heads": heads, "seq": seq,
                                        "batch": batch, "layers": 2},
                              "samples": len(breakdowns)}
    if breakdowns:
        last = breakdowns[-1]
        named = {k: getattr(last, k) for k in ("parameters", "gradients", "optimizer_states",
                                                "activations", "other")}
        result["breakdown"] = named
        if allocator:
            stats = allocator[-1]
            parts = sum(v or 0 for k, v in named.items() if k != "other")
            result["allocator"] = stats
            result["named_over_peak_allocated"] = parts / max(1, stats["allocated_bytes.all.peak"])
            result["breakdown_total_over_reserved"] = (
                (parts + (named["other"] or 0)) / max(1, stats["reserved_bytes.all.current"]))
        if profiler is not None:
            result["profiler_peak_by_category"] = profiler
            result["ratio_to_profiler"] = {
                k: (named[k] or 0) / profiler[k] for k in RATIO_KEYS if profiler.get(k)}
    else:
        result["error"] = "no step record carried a breakdown"
    out = Path(out_dir) / "memory_breakdown.json"
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def _profiler_categories(torch: Any, step: Any, device: str) -> dict[str, int] | None:
    """Peak bytes per category of PyTorch's memory profiler over one step, or ``None`` where
    its (private) timeline API is not there."""
    try:
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler import _memory_profiler as mp

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities, profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            step()
        timeline = mp.MemoryProfileTimeline(prof._memory_profile())
        _, sizes = timeline._coalesce_timeline("cuda:0" if device == "cuda" else "cpu")
        peaks: dict[str, int] = {}
        for category, index in mp._CATEGORY_TO_INDEX.items():
            name = "unknown" if category is None else _PROFILER_NAMES.get(category.name,
                                                                           category.name.lower())
            peaks[name] = max(int(row[index + 1]) for row in sizes) if sizes else 0
        return peaks
    except Exception:  # a private API: another torch may lack it
        return None
