"""The memory model of training, shared by the estimator and the live breakdown.

A GPU that trains a model holds parameters, gradients, optimizer states, activations and
everything else the allocator keeps (communication buckets, workspaces, fragmentation).
``gpumon estimate`` builds the first three from a parameter count (``model_states``); the
agent measures all five on a rank (``MemoryBreakdown`` on the wire). Both then ask the same
question — what does ZeRO do to it — and answer it with the one function here,
``shard_model_states``:

* stage 1 shards the optimizer states (the fp32 master copy of mixed precision included) over
  the data-parallel GPUs, stage 2 also the gradients, stage 3 also the parameters (Rajbhandari
  et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models");
* activations and the rest stay per GPU: data parallelism keeps each GPU's micro-batch.

Which component grows, when memory climbs towards capacity, decides what helps: ZeRO-1 for
optimizer states, ZeRO-2 for gradients, ZeRO-3 or model parallelism for parameters,
checkpointing or a smaller micro-batch for activations, and for the rest the allocator's
fragmentation or a leak. ``attribute_growth`` names it from a rank's recent breakdowns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gpumon.wire import MEMORY_COMPONENTS, MemoryBreakdown

Precision = Literal["fp16", "bf16", "fp32"]
Recompute = Literal["none", "selective", "full"]

WEIGHT_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}
"""Bytes per parameter (and per gradient) in each training precision."""
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adam": 8, "adamw": 8, "sgd": 0, "sgd_momentum": 4}
"""fp32 optimizer state per parameter: Adam's m and v, SGD's momentum buffer."""
MASTER_WEIGHT_BYTES = 4
"""The fp32 copy of the parameters mixed-precision training updates (none under fp32)."""

ZERO_STAGES = (1, 2, 3)
PROJECTION_SCALES = (1, 2, 4)
"""The live ZeRO projection covers the run's world size and twice and four times it."""


@dataclass(frozen=True, slots=True)
class ModelStates:
    """Bytes of the model states one GPU holds."""

    parameters: int
    gradients: int
    optimizer_states: int
    master_weights: int = 0

    @property
    def total(self) -> int:
        """All four together."""
        return self.parameters + self.gradients + self.optimizer_states + self.master_weights


def model_states(params: float, *, precision: str, optimizer: str, master_weights: bool) -> ModelStates:
    """Unsharded model-state bytes of ``params`` parameters (fractional: a tensor-parallel shard)."""
    weight = WEIGHT_BYTES[precision]
    master = MASTER_WEIGHT_BYTES if master_weights and precision != "fp32" else 0
    return ModelStates(
        parameters=math.ceil(params * weight),
        gradients=math.ceil(params * weight),
        optimizer_states=math.ceil(params * OPTIMIZER_STATE_BYTES[optimizer]),
        master_weights=math.ceil(params * master),
    )


def shard_model_states(states: ModelStates, zero_stage: int, data_parallel: int) -> ModelStates:
    """What one GPU of ``data_parallel`` holds of ``states`` (one GPU's full copy) under ZeRO
    ``zero_stage`` (0–3), each item rounded up to whole bytes."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if data_parallel < 1:
        raise ValueError(f"data_parallel must be at least 1, got {data_parallel!r}")

    def shard(nbytes: int, from_stage: int) -> int:
        return math.ceil(nbytes / data_parallel) if zero_stage >= from_stage else nbytes

    return ModelStates(
        parameters=shard(states.parameters, 3),
        gradients=shard(states.gradients, 2),
        optimizer_states=shard(states.optimizer_states, 1),
        master_weights=shard(states.master_weights, 1),
    )


def activation_bytes(
    *,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    batch: int,
    flash_attention: bool,
    recompute: Recompute,
    precision: Precision,
    tensor_parallel: int = 1,
) -> int:
    """Activation bytes per GPU of a transformer stack (Korthikanti et al. 2022).

    Per layer, 16-bit, tensor parallelism t, no sequence parallelism:
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``; the ``5·a·s/(h·t)`` attention-score term vanishes
    under FlashAttention or selective recomputation; full recomputation keeps only each
    layer's input, ``2·s·b·h``, plus one layer while it is recomputed. fp32 doubles it.
    """
    s, b, h, a, t = seq, batch, hidden, heads, tensor_parallel
    layer = s * b * h * (10 + 24 / t)
    if not (flash_attention or recompute == "selective"):
        layer += 5 * a * s * s * b / t
    total = layers * layer if recompute != "full" else layers * 2 * s * b * h + layer
    scale = 2 if precision == "fp32" else 1
    return math.ceil(total * scale)


# --- the live breakdown -----------------------------------------------------------------


def breakdown_total(breakdown: MemoryBreakdown) -> int:
    """The bytes the breakdown accounts for (absent parts count 0)."""
    return sum(getattr(breakdown, name) or 0 for name in MEMORY_COMPONENTS)


@dataclass(frozen=True, slots=True)
class ZeroProjection:
    """Per-GPU bytes of the measured rank's memory under one ZeRO stage over ``gpus`` GPUs."""

    stage: int
    gpus: int
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    other: int

    @property
    def total(self) -> int:
        """Everything one GPU would hold."""
        return (self.parameters + self.gradients + self.optimizer_states + self.activations
                + self.other)


def project_zero(breakdown: MemoryBreakdown, world: int,
                 scales: Sequence[int] = PROJECTION_SCALES,
                 stages: Sequence[int] = ZERO_STAGES, current_stage: int = 0) -> list[ZeroProjection]:
    """The measured breakdown under each ZeRO stage from ``current_stage`` on (the one the run
    uses, 0 for plain data parallelism) at ``world`` × each scale GPUs.

    The measurement is one rank's share under ``current_stage`` over ``world`` GPUs: what that
    stage shards (from 1 the optimizer states, from 2 also the gradients, at 3 also the
    parameters) is taken back to one replica's full model states first. The optimizer states
    include any fp32 master copy, so stage 1 shards it as the ZeRO paper's K = 12 does.
    Activations and the rest stay as measured per GPU.
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world!r}")
    if current_stage not in (0, 1, 2, 3):
        raise ValueError(f"current_stage must be 0, 1, 2 or 3, got {current_stage!r}")
    sharded = {part: world if current_stage >= from_stage else 1
               for part, from_stage in (("optimizer_states", 1), ("gradients", 2), ("parameters", 3))}
    measured = ModelStates((breakdown.parameters or 0) * sharded["parameters"],
                           (breakdown.gradients or 0) * sharded["gradients"],
                           (breakdown.optimizer_states or 0) * sharded["optimizer_states"])
    activations, other = breakdown.activations or 0, breakdown.other or 0
    out = []
    for scale in scales:
        for stage in (s for s in stages if s >= current_stage):
            held = shard_model_states(measured, stage, world * scale)
            out.append(ZeroProjection(stage, world * scale, held.parameters, held.gradients,
                                      held.optimizer_states, activations, other))
    return out


REMEDIES: dict[str, str] = {
    "optimizer_states": "ZeRO stage 1 shards optimizer states (and the fp32 master copy) "
                        "over the data-parallel GPUs",
    "gradients": "ZeRO stage 2 also shards gradients",
    "parameters": "ZeRO stage 3 (FSDP full sharding) or tensor/pipeline model parallelism "
                  "splits the parameters",
    "activations": "activation checkpointing or a smaller micro-batch (shorter sequences) "
                   "shrinks activations",
    "other": "memory no named part explains: a leak (tensors kept alive across steps, e.g. a "
             "list of outputs or of losses with their graphs) or fragmentation "
             "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, fewer distinct shapes)",
}
"""What shrinks each component, the sharding and recomputation choices of the ZeRO paper."""

GROWTH_SHARE = 0.02
"""A component whose bytes rose by this share of the rank's total over the recent samples is
"growing"; below it, a sampled breakdown moves by noise (a batch one sample shorter)."""

Cause = Literal["growing", "appeared", "largest"]


@dataclass(frozen=True, slots=True)
class MemoryAttribution:
    """The component an out-of-memory warning names, why, and what would help."""

    component: str
    cause: Cause
    """``growing`` (rose across the samples), ``appeared`` (absent or zero, then present: an
    optimizer's states after its first step) or ``largest`` (nothing grows)."""
    bytes: int
    """How much it grew by (``growing``, ``appeared``) or holds (``largest``)."""
    remedy: str

    @property
    def text(self) -> str:
        """One line for a reason or a hint."""
        gib = self.bytes / 2**30
        what = {"growing": f"{self.component} growing (+{gib:.2f} GiB)",
                "appeared": f"{self.component} appeared (+{gib:.2f} GiB)",
                "largest": f"{self.component} largest ({gib:.2f} GiB)"}[self.cause]
        return f"{what}: {self.remedy}"


def attribute_growth(samples: Sequence[tuple[float, MemoryBreakdown]]) -> MemoryAttribution | None:
    """Which component to blame, from a rank's breakdowns ``(t, breakdown)`` in time order.

    The component that rose the most between the oldest and the newest sample, when it rose
    by at least ``GROWTH_SHARE`` of the newest total — ``appeared`` when it was absent or
    zero at first; otherwise the largest component of the newest sample. ``None`` without a
    sample that measured anything.
    """
    if not samples:
        return None
    first, last = samples[0][1], samples[-1][1]
    total = breakdown_total(last)
    if total <= 0:
        return None
    best: tuple[int, str] | None = None
    for name in MEMORY_COMPONENTS:
        now = getattr(last, name)
        if now is None:
            continue
        grown = now - (getattr(first, name) or 0)
        if best is None or grown > best[0]:
            best = (grown, name)
    if best is not None and len(samples) > 1 and best[0] >= GROWTH_SHARE * total:
        grown, name = best
        cause: Cause = "appeared" if not getattr(first, name) else "growing"
        return MemoryAttribution(name, cause, grown, REMEDIES[name])
    size, name = max((getattr(last, n) or 0, n) for n in MEMORY_COMPONENTS)
    return MemoryAttribution(name, "largest", size, REMEDIES[name])
