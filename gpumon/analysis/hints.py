"""The mitigation texts a verdict carries: one per wall, per link reading, per flag and per straggler cause.

``bottleneck.classify`` decides the wall and the flags; this module only says what to try
about them, so the wording can change without touching a rule. The texts are keyed by the
values of ``Bottleneck``, ``Flag`` and ``StragglerCause`` (``"input"``, ``"throttled"``, …),
which keeps this module free of imports: the classifier looks them up with ``.value``.
Communication has no single text: which one applies depends on the link throughput and on
whether the rank waits for a slower peer, and the classifier picks among the four below.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "BUBBLE_HINT",
    "CAUSE_HINTS",
    "COMM_BANDWIDTH_HINT",
    "COMM_LATENCY_HINT",
    "COMM_UNKNOWN_HINT",
    "FLAG_HINTS",
    "WAITING_HINT",
    "WALL_HINTS",
]

WALL_HINTS: Mapping[str, str] = {
    "input": (
        "data supply: the GPU waits for batches — prefetch (DataLoader prefetch_factor, "
        "pin_memory), more DataLoader workers, cache decoded samples"
    ),
    "host": (
        "host/launch bound: the GPU idles between kernels — CUDA graphs or torch.compile to cut "
        "launch overhead, larger or fused kernels (a larger batch), fewer host syncs "
        "(.item(), .cpu(), printing tensors)"
    ),
    "memory_bandwidth": (
        "HBM bandwidth bound — operator fusion (torch.compile, fused kernels, FlashAttention), "
        "fewer intermediate reads/writes"
    ),
    "compute": (
        "compute bound — mixed precision (bf16/fp8 tensor cores), kernel work, a larger batch; "
        "beyond that, more GPUs"
    ),
}
"""Per wall other than communication (its texts follow) and unknown (which names the largest
time shares instead)."""

COMM_BANDWIDTH_HINT = (
    "communication bound, links near peak bandwidth — gradient compression or lower-precision "
    "gradients, overlap communication with compute (bucketed all-reduce), topology-aware "
    "placement (keep tensor parallelism inside NVLink)"
)
COMM_LATENCY_HINT = (
    "communication bound, links far from peak — waiting on a slower rank or latency-bound small "
    "messages: look for a straggler, use larger buckets, overlap communication with compute"
)
COMM_UNKNOWN_HINT = (
    "communication bound (link throughput unknown: no NVLink counters or peak; inter-node "
    "traffic is not visible to NVML) — overlap communication with compute, gradient compression, "
    "topology; check for a straggler"
)
BUBBLE_HINT = (
    "communication bound, a pipeline stage waiting for its neighbours ({share:.0%} of the step "
    "in its bubble) — balance the layers across stages (see which stage is slowest), more "
    "micro-batches per step, an interleaved schedule"
)
"""A format string: ``share`` is the step's share spent waiting to receive."""
WAITING_HINT = (
    "communication bound, waiting on a slower rank (rank {rank}{silent}): this rank idles in "
    "the collectives until that one joins — the fix is on that rank (its straggler cause), "
    "not on the links"
)
"""A format string: ``rank`` is the rank waited for, ``silent`` says whether it stopped reporting."""

CAUSE_HINTS: Mapping[str, str] = {
    "input": "its data wait: check its input shard, loader workers and storage",
    "host": (
        "its training thread waits for a CPU: too many threads on its cores (loader workers, "
        "OMP/intra-op threads) or another process on them — pin ranks to cores, cap threads"
    ),
    "compute": (
        "its own forward/backward work: uneven batches or sequence lengths, a CPU-starved "
        "process, a noisy neighbour on its host"
    ),
    "gpu": "its GPU: throttled, lower clocks or XID errors — check cooling, power "
           "and the GPU's error log",
    "unknown": "no phases reported to tell its input from its compute",
}
"""Per straggler cause: where on the slow rank to look."""

FLAG_HINTS: Mapping[str, str] = {
    "memory_pressure": (
        "memory pressure — ZeRO/FSDP sharding, activation checkpointing; a smaller batch shrinks "
        "only activations"
    ),
    "throttled": "clocks throttled (thermal/power slowdown) — check cooling and power",
    "straggler": (
        "straggler: its own work per step (step time less collective wait) well above its "
        "peers', who wait for it in the collectives"
    ),
}
"""Per flag; a memory breakdown's remedy replaces the generic memory-pressure text."""
