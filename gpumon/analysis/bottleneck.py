"""Which wall a training step is hitting: input, host, communication, memory bandwidth, compute.

``classify`` applies the rules of docs/architecture.md §7 in order to one step's record and the GPU window
that overlaps it. It never raises on valid records; every input but the step itself may be
missing, and a missing input lowers the confidence of the verdicts that would have used it.

What "GPU busy" means here: NVML's ``utilization_ratio`` is the share of time *any* kernel ran,
so a GPU running one small kernel at a time (or a NCCL kernel spinning on a peer) reads 100%
while most of its SMs idle. When GPM is present, SM activity (share of SM-cycles with a resident
warp) is used instead; without it, the time spent in exposed communication is subtracted from
utilisation, because communication kernels count as "busy" to NVML.

Communication is the step's collective wait (``comm.wait_s``): what the client's watcher
measured, or a hand-timed ``comm`` phase, never both added. Its share is taken out of the
phases it sat in, so ``compute`` is time the rank worked, not time it waited for a peer.
The rules read a window's share only up to the rank's typical share (the median over its
recent windows, this one included): ranks drifting apart for a step (one preempted, the others
waiting for it in the all-reduce) make one window's wait genuine but no wall the job hits.
Whether a rank is the run's straggler is decided across ranks (``straggler``); ``classify``
is told the outcome and flags it, names its cause, and tells the straggler's peers that
they wait for it. The hint texts a verdict carries live in ``hints``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from gpumon.analysis.comm import attributed_phases
from gpumon.analysis.devices import mfu
from gpumon.analysis.hints import (
    CAUSE_HINTS,
    COMM_BANDWIDTH_HINT,
    COMM_LATENCY_HINT,
    COMM_UNKNOWN_HINT,
    FLAG_HINTS,
    WAITING_HINT,
    WALL_HINTS,
)
from gpumon.analysis.straggler import SlowerRank, StragglerCause
from gpumon.analysis.thresholds import DEFAULT, Thresholds
from gpumon.analysis.window import GpuWindow
from gpumon.wire import StepRecord

__all__ = [
    "DEFAULT",
    "FRACTION_KEYS",
    "Bottleneck",
    "Flag",
    "Thresholds",
    "Verdict",
    "classify",
    "phase_fractions",
]


class Bottleneck(str, Enum):
    """The wall a step is hitting (the five walls, docs/architecture.md §1, plus host and unknown)."""

    INPUT = "input"
    HOST = "host"
    COMMUNICATION = "communication"
    MEMORY_BANDWIDTH = "memory_bandwidth"
    COMPUTE = "compute"
    UNKNOWN = "unknown"


class Flag(str, Enum):
    """Conditions reported beside the primary verdict."""

    MEMORY_PRESSURE = "memory_pressure"
    THROTTLED = "throttled"
    STRAGGLER = "straggler"


FRACTION_KEYS = ("input", "compute", "comm", "optimizer", "other")


@dataclass(frozen=True, slots=True)
class Verdict:
    """The classifier's answer for one step."""

    primary: Bottleneck
    confidence: float
    """0–1: how strongly the evidence supports ``primary``, lowered for every missing input."""
    fractions: dict[str, float]
    """Share of the step's time per category (``FRACTION_KEYS``); sums to 1 (``other`` = 1
    when no phases were reported)."""
    flags: frozenset[Flag]
    hint: str
    mfu: float | None = None
    straggler_cause: StragglerCause | None = None
    """Why this rank is the run's straggler (with ``Flag.STRAGGLER``)."""
    slower_rank: int | None = None
    """On a communication verdict: the run's rank this one waits for in the collectives."""


# Multipliers applied to a verdict's confidence for each input it would have used but lacked.
# Their sizes rank how much each input tells: phases decide rules 2–4, the GPU window rules 4–6,
# GPM separates "busy" from "saturated", flops give MFU and the roofline, peer ranks tell
# waiting-on-a-peer from slow links, and a mean over a single sample is weak.
_PENALTIES = {
    "phases": 0.6,
    "window": 0.7,
    "gpm": 0.8,
    "flops": 0.85,
    "peers": 0.9,
    "samples": 0.9,
}
_MISSING_LINK = 0.9
_ALL_INPUTS = tuple(_PENALTIES)
# Which inputs each verdict would have used. Input and communication shares come from phases,
# which those rules cannot fire without; the GPU window only corroborates them.
_USES: dict[Bottleneck, tuple[str, ...]] = {
    Bottleneck.INPUT: ("window",),
    Bottleneck.COMMUNICATION: ("window", "peers"),
    Bottleneck.HOST: ("phases", "gpm", "samples"),
    Bottleneck.MEMORY_BANDWIDTH: ("phases", "flops", "samples"),
    Bottleneck.COMPUTE: ("phases", "gpm", "flops", "samples"),
    Bottleneck.UNKNOWN: _ALL_INPUTS,
}

def phase_fractions(step: StepRecord) -> dict[str, float] | None:
    """Share of the step per category, or ``None`` when it reported neither (positive)
    phases nor measured communication.

    ``data`` → input, ``forward`` + ``backward`` → compute, ``comm``, ``optimizer``; free-form
    phases and time no phase covers → other. Communication is the collective wait, taken out
    of the phases it sat in (``comm.attributed_phases``). The denominator is the larger of the
    step's duration and its phases' sum, so a client that times the data wait outside the
    step still gets shares that sum to 1.
    """
    phases = attributed_phases(step)
    if not phases:
        return None
    total = max(step.duration_s, sum(phases.values()))
    shares = {
        "input": phases.get("data", 0.0) / total,
        "compute": (phases.get("forward", 0.0) + phases.get("backward", 0.0)) / total,
        "comm": phases.get("comm", 0.0) / total,
        "optimizer": phases.get("optimizer", 0.0) / total,
    }
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def classify(
    step: StepRecord,
    gpu: GpuWindow | None,
    *,
    peak_flops: float | None,
    memory_total_bytes: int | None,
    peak_dram_bytes_per_second: float | None = None,
    peak_nvlink_bytes_per_second: float | None = None,
    straggler_score: float | None = None,
    straggler_cause: StragglerCause | None = None,
    slower_rank: SlowerRank | None = None,
    previous_alloc_retries: int | None = None,
    previous_ooms: int | None = None,
    thresholds: Thresholds = DEFAULT,
    memory_remedy: str | None = None,
    recent_comm: Sequence[float] = (),
) -> Verdict:
    """Classify one step (docs/architecture.md §7): primary wall, confidence, time shares, flags and a hint.

    ``previous_alloc_retries``/``previous_ooms`` are the rank's cumulative allocator counters at
    its previous step: retries or OOMs *rising* signal pressure (without ``previous_ooms``, any
    OOM so far does). ``straggler_score``, ``straggler_cause`` and ``slower_rank`` come from
    comparing the run's ranks (``straggler.judge_run``): a cause flags this rank as its
    run's straggler (a score alone does not: the comparison also weighs the extra's share
    of the step and its persistence); ``slower_rank`` names the rank it waits for when its
    verdict is communication. ``memory_remedy`` replaces the generic memory-pressure hint
    when the rank's memory breakdown names what fills it
    (``gpumon.analysis.memory.attribute_growth``). ``recent_comm`` are the communication shares
    of the rank's previous windows: the rules read this window's share at most at the median of
    those and this one (the shares reported stay as measured).
    """
    th = thresholds
    measured = phase_fractions(step)
    fractions = measured if measured is not None else {k: 0.0 for k in FRACTION_KEYS}
    if measured is None:
        fractions["other"] = 1.0
    data = measured["input"] if measured is not None else None
    comm = measured["comm"] if measured is not None else None
    rule_comm = comm if comm is None or not recent_comm \
        else min(comm, statistics.median([*recent_comm, comm]))

    step_mfu = None
    if (step.flops is not None and math.isfinite(step.flops) and step.flops >= 0
            and peak_flops is not None and peak_flops > 0 and step.duration_s > 0):
        step_mfu = mfu(step.flops, step.duration_s, peak_flops)

    busy = _busy_excluding_waits(gpu, data or 0.0, comm or 0.0)
    sm = gpu.sm_active_ratio if gpu is not None else None
    tensor = gpu.tensor_active_ratio if gpu is not None else None
    dram = gpu.dram_active_ratio if gpu is not None else None
    gpu_busy = busy is None or busy >= th.host_busy_max
    gpm_membw = (dram is not None and tensor is not None
                 and dram >= th.membw_dram_min and tensor < th.membw_tensor_max)
    roofline = _roofline_memory_bound(step, dram, peak_flops, peak_dram_bytes_per_second, th)
    gpm_compute = (sm is not None and tensor is not None
                   and sm >= th.compute_sm_min and tensor >= th.compute_tensor_min)
    mfu_compute = step_mfu is not None and step_mfu >= th.compute_mfu_min

    missing = {
        "phases": measured is None,
        "window": gpu is None,
        "gpm": gpu is None or not gpu.has_gpm,
        "flops": step_mfu is None,
        "peers": straggler_score is None,
        "samples": gpu is not None and gpu.sample_count < 2,
    }

    primary = Bottleneck.UNKNOWN
    strength = 0.3
    moderate = False
    if data is not None and data >= th.input_high_fraction:
        primary = Bottleneck.INPUT
        strength = 0.6 + 0.4 * _margin(data, th.input_high_fraction, 0.5)
    elif rule_comm is not None and rule_comm >= th.comm_high_fraction:
        primary = Bottleneck.COMMUNICATION
        strength = 0.6 + 0.4 * _margin(rule_comm, th.comm_high_fraction, 0.5)
    elif busy is not None and busy < th.host_busy_max:
        primary = Bottleneck.HOST
        strength = 0.6 + 0.4 * _margin(th.host_busy_max - busy, 0.0, th.host_busy_max)
    elif gpu_busy and dram is not None and (gpm_membw or roofline):
        primary = Bottleneck.MEMORY_BANDWIDTH
        strength = 0.0
        if gpm_membw:
            strength = 0.6 + 0.4 * _margin(dram, th.membw_dram_min, 0.9)
        if roofline:
            strength = max(strength, 0.55 + 0.35 * _margin(dram, th.roofline_dram_min, 0.9))
    elif gpu_busy and (gpm_compute or mfu_compute):
        primary = Bottleneck.COMPUTE
        strength = 0.0
        if gpm_compute and sm is not None and tensor is not None:
            strength = 0.6 + 0.4 * min(_margin(sm, th.compute_sm_min, 1.0),
                                       _margin(tensor, th.compute_tensor_min, 0.9))
        if mfu_compute and step_mfu is not None:
            strength = max(strength, 0.6 + 0.4 * _margin(step_mfu, th.compute_mfu_min, 0.6))
    elif gpu is not None:
        # No rule fired outright, and the GPU was seen not to be the explanation: a moderate
        # input or communication share, if any, is the best one left (the larger of the
        # two). Without a GPU window a moderate share is no evidence (a fast CPU step with a
        # small data wait would otherwise read as input-bound): the verdict stays unknown.
        candidates = [
            (value, bottleneck, low, high)
            for value, bottleneck, low, high in (
                (data, Bottleneck.INPUT, th.input_moderate_fraction, th.input_high_fraction),
                (rule_comm, Bottleneck.COMMUNICATION, th.comm_moderate_fraction,
                 th.comm_high_fraction),
            )
            if value is not None and value >= low
        ]
        if candidates:
            value, primary, low, high = max(candidates, key=lambda c: c[0] or 0.0)
            strength = 0.3 + 0.2 * _margin(value or 0.0, low, high)
            moderate = True

    waiting_on = None
    if primary is Bottleneck.COMMUNICATION and slower_rank is not None \
            and slower_rank.rank != step.rank:
        # Waiting on a peer is established by the comparison itself: link figures add nothing.
        waiting_on = slower_rank.rank
        hint = WAITING_HINT.format(
            rank=slower_rank.rank, silent=", which stopped reporting" if slower_rank.silent else "")
    elif primary is Bottleneck.COMMUNICATION:
        hint, link_known = _comm_hint(gpu, comm or 0.0, peak_nvlink_bytes_per_second, th)
        if not link_known:
            strength *= _MISSING_LINK
    elif primary is Bottleneck.UNKNOWN:
        hint = "no rule fired; largest shares: " + _largest_shares(fractions)
    else:
        hint = WALL_HINTS[primary.value]
    if moderate:
        hint = f"moderately {primary.value}-bound; {hint}"

    uses = _ALL_INPUTS if moderate else _USES[primary]
    confidence = strength
    for name in uses:
        if missing[name]:
            confidence *= _PENALTIES[name]
    confidence = min(1.0, max(0.0, confidence))

    flags = _flags(step, gpu, memory_total_bytes, straggler_cause, previous_alloc_retries,
                   previous_ooms, th)
    cause = None
    for flag in (Flag.MEMORY_PRESSURE, Flag.THROTTLED, Flag.STRAGGLER):
        if flag in flags:
            remedy = memory_remedy if flag is Flag.MEMORY_PRESSURE else None
            hint += "; " + (f"memory pressure — {remedy}" if remedy else FLAG_HINTS[flag.value])
    if Flag.STRAGGLER in flags:
        cause = straggler_cause or StragglerCause.UNKNOWN
        hint += f"; cause: {cause.value} — {CAUSE_HINTS[cause.value]}"
    return Verdict(primary, confidence, fractions, frozenset(flags), hint, step_mfu, cause,
                   waiting_on)


def _flags(
    step: StepRecord,
    gpu: GpuWindow | None,
    memory_total_bytes: int | None,
    straggler_cause: StragglerCause | None,
    previous_alloc_retries: int | None,
    previous_ooms: int | None,
    th: Thresholds,
) -> set[Flag]:
    flags: set[Flag] = set()
    total = memory_total_bytes
    if total is None and gpu is not None:
        total = gpu.memory_total_bytes
    mem = step.mem
    peak: int | None = None
    if mem is not None:
        if mem.ooms is not None and mem.ooms > (previous_ooms or 0):
            flags.add(Flag.MEMORY_PRESSURE)
        if (mem.alloc_retries is not None and previous_alloc_retries is not None
                and mem.alloc_retries > previous_alloc_retries):
            flags.add(Flag.MEMORY_PRESSURE)
        peak = mem.peak_bytes
    if peak is None and gpu is not None:
        # Without allocator stats (not PyTorch, or no CUDA in the client), NVML's view of
        # the device is the best available peak.
        peak = gpu.memory_used_bytes_max
    if peak is not None and total and peak / total >= th.memory_pressure_peak_ratio:
        flags.add(Flag.MEMORY_PRESSURE)
    if gpu is not None and any(
        gpu.clock_event_fractions.get(reason, 0.0) > 0 for reason in th.throttle_reasons
    ):
        flags.add(Flag.THROTTLED)
    if straggler_cause is not None:
        # The comparison decided (score, share of the step, persistence); a score alone may
        # be low on a rank that is not worth flagging.
        flags.add(Flag.STRAGGLER)
    return flags


def _busy_excluding_waits(gpu: GpuWindow | None, data: float, comm: float) -> float | None:
    """GPU busy share over the part of the step not spent waiting for input or communication."""
    if gpu is None:
        return None
    working = 1.0 - data - comm
    if working <= 0.05:
        return None
    if gpu.sm_active_ratio is not None:
        busy = gpu.sm_active_ratio
    elif gpu.utilization_ratio is not None:
        # NCCL kernels run (and spin) through exposed communication; NVML counts them as busy.
        busy = max(0.0, gpu.utilization_ratio - comm)
    else:
        return None
    return min(1.0, busy / working)


def _roofline_memory_bound(
    step: StepRecord,
    dram: float | None,
    peak_flops: float | None,
    peak_dram: float | None,
    th: Thresholds,
) -> bool:
    """Arithmetic intensity (FLOP per DRAM byte) below the device's ridge point, at the roof.

    Achieved FLOP/s ÷ achieved bytes/s < peak FLOP/s ÷ peak bytes/s reduces to MFU < DRAM
    activity: the step uses more of the bandwidth roof than of the compute roof.
    """
    if (step.flops is None or dram is None or not peak_flops or not peak_dram
            or step.duration_s <= 0 or dram <= 0):
        return False
    intensity = (step.flops / step.duration_s) / (dram * peak_dram)
    ridge = peak_flops / peak_dram
    return intensity < ridge and dram >= th.roofline_dram_min


def _comm_hint(
    gpu: GpuWindow | None, comm: float, peak_nvlink: float | None, th: Thresholds
) -> tuple[str, bool]:
    """The communication hint, and whether link throughput could be judged at all."""
    if gpu is None or not peak_nvlink or comm <= 0:
        return COMM_UNKNOWN_HINT, False
    rates = [r for r in (gpu.nvlink_tx_bytes_per_second, gpu.nvlink_rx_bytes_per_second)
             if r is not None]
    if not rates:
        return COMM_UNKNOWN_HINT, False
    # The window's mean rate, attributed to the exposed communication time. Traffic that
    # overlapped backward is attributed too, so this errs towards "bandwidth".
    during_comm = min(1.0, max(rates) / peak_nvlink / comm)
    if during_comm >= th.link_bandwidth_bound_ratio:
        return COMM_BANDWIDTH_HINT, True
    return COMM_LATENCY_HINT, True


def _largest_shares(fractions: Mapping[str, float]) -> str:
    ranked = sorted(fractions.items(), key=lambda kv: kv[1], reverse=True)
    return ", ".join(f"{name} {share:.0%}" for name, share in ranked[:2] if share > 0) or "none"


def _margin(value: float, low: float, high: float) -> float:
    """Where ``value`` lies between ``low`` (0) and ``high`` (1), clipped."""
    if high <= low:
        return 1.0 if value >= high else 0.0
    return min(1.0, max(0.0, (value - low) / (high - low)))
