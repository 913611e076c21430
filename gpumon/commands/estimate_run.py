"""`gpumon estimate --from-run RUN`: a running job's measured memory beside its ZeRO projections.

The agent's snapshot carries each rank's sampled breakdown (``watch(model, optimizer)``);
this command takes the run's fullest rank (the one that runs out first), projects it with
the same memory model as the estimator (``gpumon.analysis.memory.project_zero``) and prints
it in the estimator's format: one row per item, GB = 10⁹ bytes, then what fits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gpumon.analysis.estimate import GB
from gpumon.analysis.memory import (
    PROJECTION_SCALES,
    ZERO_STAGES,
    ZeroProjection,
    breakdown_total,
    project_zero,
)
from gpumon.commands.top import fetch_snapshot
from gpumon.wire import MEMORY_COMPONENTS, MemoryBreakdown

_ITEMS = (("parameters", "parameters"), ("gradients", "gradients"),
          ("optimizer_states", "optimizer states"), ("activations", "activations"),
          ("other", "other (buffers, cache)"))


def from_run_command(run: str, url: str, *, gpu_memory_bytes: int | None,
                     json_output: bool) -> str:
    """The command's output; ``ValueError`` (bad URL, no such run, no breakdown) or ``OSError``
    (agent unreachable) with the message."""
    snapshot = fetch_snapshot(url)
    ranks = [r for r in snapshot.get("ranks") or [] if r.get("run") == run]
    if not ranks:
        known = sorted({str(r.get("run")) for r in snapshot.get("ranks") or []})
        raise ValueError(f"run {run!r} is not reporting to {url}"
                         + (f" (runs: {', '.join(known)})" if known else ""))
    measured = [(r, _breakdown(r["memory_breakdown"])) for r in ranks if r.get("memory_breakdown")]
    if not measured:
        raise ValueError(f"run {run!r} sends no memory breakdown: call "
                         "mon.watch(model, optimizer) in the training script")
    rank, breakdown = max(measured, key=lambda m: breakdown_total(m[1]))
    world = int(rank.get("world") or 1)
    capacity = gpu_memory_bytes or _capacity(snapshot, rank)
    projections = project_zero(breakdown, world)
    if json_output:
        return json.dumps(_json(run, rank, breakdown, world, capacity, projections))
    return render_run_table(run, rank, breakdown, world, capacity, projections, len(measured))


def render_run_table(run: str, rank: Mapping[str, Any], breakdown: MemoryBreakdown, world: int,
                     capacity: int | None, projections: list[ZeroProjection],
                     ranks_measured: int) -> str:
    """The measured column and ZeRO 1–3 at the run's world size, totals at 2x and 4x, advice."""
    at_world = {p.stage: p for p in projections if p.gpus == world}
    headers = ["measured", *(f"ZeRO-{s}" for s in ZERO_STAGES)]
    rows = []
    for name, label in _ITEMS:
        value = getattr(breakdown, name)
        rows.append([label, "—" if value is None else _gb(value),
                     *(_gb(getattr(at_world[s], name)) for s in ZERO_STAGES)])
    rows.append(["total", _gb(breakdown_total(breakdown)),
                 *(_gb(at_world[s].total) for s in ZERO_STAGES)])
    for scale in PROJECTION_SCALES[1:]:
        gpus = world * scale
        totals = {p.stage: p.total for p in projections if p.gpus == gpus}
        rows.append([f"total on {gpus} GPUs", "", *(_gb(totals[s]) for s in ZERO_STAGES)])
    if capacity:
        rows.append(["GPU memory", _gb(capacity), "", "", ""])
    title = (f"run {run}, rank {rank.get('rank')} of {world} (the fullest of {ranks_measured} "
             f"measured), per GPU; ZeRO columns on {world} GPU{'s' if world > 1 else ''}")
    widths = [max(len(r[i]) for r in [["item", *headers], *rows]) for i in range(5)]
    lines = [title, "  ".join([f"{'item':<{widths[0]}}",
                               *(f"{h:>{w}}" for h, w in zip(headers, widths[1:], strict=True))])]
    for row in rows:
        lines.append("  ".join([f"{row[0]:<{widths[0]}}",
                                *(f"{c:>{w}}" for c, w in zip(row[1:], widths[1:], strict=True))])
                     .rstrip())
    lines += ["", "advice:"] + [f"  - {a}" for a in _advice(breakdown, world, capacity,
                                                           projections, rank)]
    lines += ["notes:",
              "  - measured on the running job (sampled); optimizer states include fp32 master "
              "copies (the ZeRO paper's K = 12)",
              "  - projections shard the measured model states as plain data parallelism holds "
              "them; activations and other stay per GPU"]
    return "\n".join(lines) + "\n"


def _advice(breakdown: MemoryBreakdown, world: int, capacity: int | None,
            projections: list[ZeroProjection], rank: Mapping[str, Any]) -> list[str]:
    advice: list[str] = []
    named = (rank.get("analysis") or {}).get("memory")
    if named:
        advice.append(f"{named['component']} {named['cause']}: {named['remedy']}")
    if capacity is None:
        return [*advice, "no GPU memory known (give --gpu-memory): cannot say what fits"]
    total = breakdown_total(breakdown)
    if total <= capacity:
        advice.insert(0, f"fits as measured: {_gb(total)} of {_gb(capacity)} per GPU")
        return advice
    fitting = [p for p in projections if p.total <= capacity]
    if fitting:
        best = min(fitting, key=lambda p: (p.gpus, p.stage))
        advice.insert(0, f"fits with ZeRO-{best.stage} on {best.gpus} GPUs "
                         f"({_gb(best.total)} per GPU)")
    else:
        floor = (breakdown.activations or 0) + (breakdown.other or 0)
        advice.insert(0, f"no ZeRO stage fits on up to {world * PROJECTION_SCALES[-1]} GPUs: "
                         f"activations and other alone are {_gb(floor)}; activation "
                         "checkpointing, a smaller micro-batch or model parallelism")
    return advice


def _json(run: str, rank: Mapping[str, Any], breakdown: MemoryBreakdown, world: int,
          capacity: int | None, projections: list[ZeroProjection]) -> dict[str, object]:
    return {
        "run": run, "rank": rank.get("rank"), "world": world, "gpu_memory": capacity,
        "measured": {name: getattr(breakdown, name) for name in MEMORY_COMPONENTS}
        | {"total": breakdown_total(breakdown)},
        "projections": [{"stage": p.stage, "gpus": p.gpus, "parameters": p.parameters,
                         "gradients": p.gradients, "optimizer_states": p.optimizer_states,
                         "activations": p.activations, "other": p.other, "total": p.total,
                         "fits": None if capacity is None else p.total <= capacity}
                        for p in projections],
        "advice": _advice(breakdown, world, capacity, projections, rank),
    }


def _breakdown(parts: Mapping[str, Any]) -> MemoryBreakdown:
    return MemoryBreakdown(**{k: parts.get(k) for k in MEMORY_COMPONENTS})


def _capacity(snapshot: Mapping[str, Any], rank: Mapping[str, Any]) -> int | None:
    """The memory of the rank's GPU: the one the agent attributed it to, else the UUID it
    reported."""
    index = (rank.get("analysis") or {}).get("gpu")
    for gpu in snapshot.get("gpus") or []:
        mine = gpu.get("index") == index if index is not None else gpu.get("uuid") == rank.get("gpu")
        if mine and isinstance(gpu.get("memory_total_bytes"), int):
            return int(gpu["memory_total_bytes"])
    return None


def _gb(n: int) -> str:
    """GB as the estimator prints them; MB below one GB (a small job would read all 0.0)."""
    return f"{n / GB:.1f} GB" if n >= GB or n == 0 else f"{n / 10**6:.1f} MB"
