"""What the simulated job is made of: its model's size and what a step all-reduces, and for
each kind of schedule phase the step it makes (``Profile``: phase durations, and the kernels a
GPU runs, ``Kernels``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gpumon.sim.schedule import Phase, PhaseKind

PARAMS = 1.3e9
SAMPLES_PER_STEP = 8
TOKENS_PER_STEP = SAMPLES_PER_STEP * 2048
FLOPS_PER_STEP = 6 * PARAMS * TOKENS_PER_STEP  # forward + backward, per rank
"""A 1.3B-parameter model on 8 sequences of 2048 tokens per rank and step: about 0.13 PFLOP,
which makes a compute-bound step of ~0.25 s run at ~50 % MFU on an H100."""

GRADIENT_BYTES = int(2 * PARAMS)
"""bf16 gradients, all-reduced every step."""
BUCKET_BYTES = 25 * 1024**2
"""DDP's default bucket size (``bucket_cap_mb=25``): one all-reduce per bucket."""
BUCKETS = math.ceil(GRADIENT_BYTES / BUCKET_BYTES)

BASE_PEAK_RATIO = 0.60
"""Per-step allocator peak (weights, gradients, optimizer states and activations) ÷ capacity."""
PERSISTENT_RATIO = 0.30
"""What stays allocated between steps (weights, gradients, optimizer states) ÷ capacity."""
CACHE_BYTES = 512 * 1024**2
"""Memory the allocator keeps reserved above the peak."""
CONTEXT_BYTES = 512 * 1024**2
"""What NVML counts beyond the allocator's reservation: the CUDA context."""


@dataclass(frozen=True)
class Kernels:
    """What a GPU shows while it runs one kind of work, as ratios of its peak."""

    utilization: float
    sm_active: float
    sm_occupancy: float
    tensor_active: float
    dram_active: float
    nvlink_ratio: float = 0.0
    pcie_ratio: float = 0.0


DENSE = Kernels(1.0, 0.93, 0.50, 0.76, 0.36)
"""Large bf16 matrix multiplications: tensor cores busy, HBM well below its roof."""
MEMORY_BOUND = Kernels(1.0, 0.90, 0.62, 0.14, 0.86)
"""Unfused element-wise and normalisation kernels: HBM at its roof, tensor cores idle."""
LAUNCH_BOUND = Kernels(0.60, 0.30, 0.12, 0.20, 0.12)
"""Tiny kernels with gaps between launches: the CPU cannot issue them fast enough. NVML's
utilisation (any kernel running) stays well above the SM activity."""
WAITING_FOR_DATA = Kernels(0.0, 0.0, 0.0, 0.0, 0.0, pcie_ratio=0.02)
WAITING_FOR_PEERS = Kernels(1.0, 0.06, 0.03, 0.0, 0.02)
"""An all-reduce kernel already launched, spinning until the slowest rank joins."""
IDLE = Kernels(0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Profile:
    """One phase kind's step: phase durations (seconds) and the kernels it runs."""

    description: str
    kernels: Kernels = DENSE
    data_s: float = 0.003
    forward_s: float = 0.075
    backward_s: float = 0.14
    optimizer_s: float = 0.02
    allreduce_s: float = 0.01
    """The all-reduce once every rank is ready (the part not overlapped with backward)."""
    link_ratio: float = 0.9
    """NVLink use during that all-reduce, of the link's peak."""
    overlap_link_ratio: float = 0.15
    """NVLink use during backward, where bucketed all-reduces overlap it."""
    overlapped_share: float = 0.8
    """Share of backward during which a bucket's all-reduce is in flight (DDP launches the
    first bucket soon after backward starts)."""


_HEALTHY = Profile("compute-bound: tensor cores busy, MFU about 50 %")
PROFILES: dict[PhaseKind, Profile] = {
    PhaseKind.COMPUTE: _HEALTHY,
    PhaseKind.INPUT: replace(_HEALTHY, data_s=0.26,
                             description="input-bound: the data loader cannot keep up, "
                                         "GPUs idle half of each step"),
    PhaseKind.COMMUNICATION: replace(_HEALTHY, allreduce_s=0.2, link_ratio=0.85,
                                     overlap_link_ratio=0.0, overlapped_share=0.0,
                                     description="communication-bound: the gradient all-reduce "
                                                 "is no longer overlapped, NVLink saturated"),
    PhaseKind.MEMORY_BANDWIDTH: replace(_HEALTHY, kernels=MEMORY_BOUND, forward_s=0.16,
                                        backward_s=0.29, optimizer_s=0.045,
                                        description="memory-bandwidth-bound: unfused kernels "
                                                    "keep HBM busy and tensor cores idle"),
    PhaseKind.HOST: replace(_HEALTHY, kernels=LAUNCH_BOUND, forward_s=0.19, backward_s=0.30,
                            optimizer_s=0.06,
                            description="host-bound: many tiny kernels, the CPU cannot launch "
                                        "them fast enough"),
    PhaseKind.STRAGGLER: replace(_HEALTHY, description="one rank computes slower; its peers "
                                                       "wait for it in the all-reduce"),
    PhaseKind.LEAK: replace(_HEALTHY, description="memory leak: every step's peak grows "
                                                  "toward capacity"),
}


def describe(phase: Phase) -> str:
    """A one-line account of what the job does in ``phase``."""
    text = PROFILES[phase.kind].description
    if phase.kind is PhaseKind.STRAGGLER:
        text += f" (compute x{phase.slowdown:g})"
    elif phase.kind is PhaseKind.LEAK:
        text += f" (to {phase.peak_ratio:.0%} by the end)"
    return text
