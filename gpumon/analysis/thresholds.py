"""The bottleneck classifier's thresholds (docs/architecture.md §7): named, documented, overridable."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Every threshold the classifier uses; override any of them with ``dataclasses.replace``."""

    memory_pressure_peak_ratio: float = 0.90
    """Per-step allocator peak ÷ device memory at or above which memory pressure is flagged
    (docs/architecture.md §7 rule 1)."""

    input_high_fraction: float = 0.20
    """Data-wait share of the step from which it is input bound. TensorFlow's (xprof) input
    pipeline analyzer calls a step "highly input-bound" above 20% input time."""

    input_moderate_fraction: float = 0.05
    """Data-wait share from which input is a moderate cause, the same analyzer's "moderately
    input-bound" band (5–20%); below it input is not a factor."""

    comm_high_fraction: float = 0.15
    """Exposed (non-overlapped) communication share from which a step is communication bound
    (docs/architecture.md §7 rule 3, a starting value to be tuned with evidence)."""

    comm_moderate_fraction: float = 0.05
    """Exposed communication share from which communication is a moderate cause; the 5% floor
    mirrors the input analyzer's."""

    link_bandwidth_bound_ratio: float = 0.6
    """NVLink throughput during the exposed communication, as a share of the link's peak, from
    which communication is bandwidth- rather than latency/wait-bound. A heuristic: large
    all-reduces in nccl-tests reach well above it, latency-bound or waiting ranks far below."""

    host_busy_max: float = 0.5
    """GPU busy share (SM activity with GPM, else utilisation) below which a step not explained
    by input or communication is host bound — launch- or CPU-bound (docs/architecture.md §7 rule 4)."""

    membw_dram_min: float = 0.6
    """GPM DRAM-bandwidth activity from which a busy GPU is memory-bandwidth bound, together
    with ``membw_tensor_max`` (docs/architecture.md §7 rule 5)."""

    membw_tensor_max: float = 0.3
    """Tensor-core activity below which high DRAM activity means bandwidth, not math, limits."""

    roofline_dram_min: float = 0.4
    """For the roofline path of rule 5: below the ridge point a step's ceiling is bandwidth, and
    the share of that ceiling it reaches equals its DRAM activity; this is the least activity at
    which it is said to be *at* the bandwidth roof rather than merely below the ridge
    (a heuristic)."""

    compute_sm_min: float = 0.8
    """SM activity from which a GPU counts as compute-saturated (docs/architecture.md §7 rule 6)."""

    compute_tensor_min: float = 0.5
    """Tensor-core activity required beside ``compute_sm_min`` (docs/architecture.md §7 rule 6)."""

    compute_mfu_min: float = 0.35
    """MFU from which a step is compute bound. Well-tuned large-model training reports 30–55%:
    PaLM paper (Chowdhery et al. 2022, table 3) lists 21.3% GPT-3, 30.2% Megatron-Turing NLG,
    46.2% PaLM 540B."""

    straggler_score_max: float = 0.75
    """A rank whose score — its peers' mean own work per step ÷ its own, own work being step
    time minus the time blocked on collectives (docs/architecture.md §7 rule 8) — is below
    this is a straggler: its own work is above 1/0.75 ≈ 1.33× its peers'. The score is the
    same kind of ratio NVIDIA's nvidia-resiliency-ext straggler detection reports (reference
    ÷ own time, 1 best), which flags below 0.75 too; NeMo/Megatron-Bridge default theirs to
    0.7 against the *fastest* rank. Set 0.8 to flag from 1.25×."""

    straggler_extra_share_min: float = 0.10
    """The least share of its step a straggler's extra own work (its median own work less
    its peers' mean) must be for it to be flagged. A ratio of own work alone is not enough
    where own work is a small part of the step: on a communication-heavy job, or one whose
    ranks mostly wait, a few milliseconds of scheduling noise make one rank's own work 1.5x
    its peers' while removing them would shorten the run's step by a few per cent — not a
    finding anyone should act on. A tenth of the step is what fixing the straggler would
    win at least."""

    straggler_clock_ratio_max: float = 0.9
    """A straggler whose GPU's SM clock is below this share of its peers' median has a slow
    GPU as its cause (a clock 10 % down costs about 10 % of compute-bound step time, which
    the run's other GPUs do not lose)."""

    throttle_reasons: frozenset[str] = field(
        default_factory=lambda: frozenset(
            {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"}
        )
    )
    """NVML clock-event reasons that count as throttling. ``sw_power_cap`` is left out: a busy
    H100 sits at its power limit in normal operation; add it to flag that too."""

    def __post_init__(self) -> None:
        for name in (
            "memory_pressure_peak_ratio", "input_high_fraction", "input_moderate_fraction",
            "comm_high_fraction", "comm_moderate_fraction", "link_bandwidth_bound_ratio",
            "host_busy_max", "membw_dram_min", "membw_tensor_max", "roofline_dram_min",
            "compute_sm_min", "compute_tensor_min", "compute_mfu_min", "straggler_score_max",
            "straggler_extra_share_min", "straggler_clock_ratio_max",
        ):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"threshold {name} must be within [0, 1], got {value!r}")
        if self.input_moderate_fraction > self.input_high_fraction:
            raise ValueError("input_moderate_fraction exceeds input_high_fraction")
        if self.comm_moderate_fraction > self.comm_high_fraction:
            raise ValueError("comm_moderate_fraction exceeds comm_high_fraction")


DEFAULT = Thresholds()
