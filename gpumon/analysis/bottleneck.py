"""Which wall a training step is hitting: input, host, communication, memory bandwidth, compute.

``classify`` reads one step's evidence (``StepEvidence``: its record, the GPU window that
overlaps it, what the device can do, how the rank compares with its peers) as the figures the
rules read (``rules.Shares``), and tries the rules of docs/architecture.md §7 in order: each
row of ``rules.RULES`` is one way a step shows a wall, with the threshold it fires from and its
strength.
It never raises on valid records; every input but the step itself may be missing, and a
missing input lowers the confidence of the verdicts that would have used it.

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

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from gpumon.analysis.comm import attributed_phases
from gpumon.analysis.devices import mfu
from gpumon.analysis.hints import (
    BUBBLE_HINT,
    CAUSE_HINTS,
    COMM_BANDWIDTH_HINT,
    COMM_LATENCY_HINT,
    COMM_UNKNOWN_HINT,
    FLAG_HINTS,
    WAITING_HINT,
    WALL_HINTS,
)
from gpumon.analysis.rules import (
    MODERATE_RULES,
    RULES,
    UNKNOWN_STRENGTH,
    Bottleneck,
    Rule,
    Shares,
)
from gpumon.analysis.straggler import Standing, StragglerCause
from gpumon.analysis.thresholds import DEFAULT, Thresholds
from gpumon.analysis.window import GpuWindow
from gpumon.wire import MemoryStats, StepRecord

__all__ = [
    "DEFAULT",
    "FRACTION_KEYS",
    "MODERATE_RULES",
    "RULES",
    "Bottleneck",
    "DeviceSpec",
    "Flag",
    "Rule",
    "Shares",
    "StepEvidence",
    "Thresholds",
    "Verdict",
    "classify",
    "phase_fractions",
]


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
    bubble: float | None = None
    """Share of the step spent waiting to receive from another rank (a pipeline stage's
    bubble), beside ``fractions["comm"]``, which holds it; ``None`` without receives."""


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

@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """What the rank's GPU can do, by its NVML name (``devices``); ``None`` where unknown."""

    peak_flops: float | None = None
    memory_total_bytes: int | None = None
    peak_dram_bytes_per_second: float | None = None
    peak_nvlink_bytes_per_second: float | None = None


@dataclass(frozen=True, slots=True)
class StepEvidence:
    """Everything known about one step (or a window of merged steps) that the rules read.

    Only ``step`` is required: every other input may be missing, and a missing input lowers
    the confidence of the verdicts that would have used it.
    """

    step: StepRecord
    gpu: GpuWindow | None = None
    """The GPU's samples over the step."""
    device: DeviceSpec = DeviceSpec()
    standing: Standing = Standing()
    """What comparing the rank with its run's peers said (``straggler.judge_run``): a cause
    flags it as its run's straggler (a score alone does not: the comparison also weighs the
    extra's share of the step and its persistence); ``slower_rank`` names the rank it waits
    for when its verdict is communication. No score: it had no peers to compare with."""
    previous_mem: MemoryStats | None = None
    """The rank's allocator counters at its previous step: retries or OOMs *rising* signal
    pressure (without a previous OOM count, any OOM so far does)."""
    memory_remedy: str | None = None
    """Replaces the generic memory-pressure hint when the rank's memory breakdown names what
    fills it (``gpumon.analysis.memory.attribute_growth``)."""
    recent_comm: Sequence[float] = ()
    """The communication shares of the rank's previous windows: the rules read this window's
    share at most at the median of those and this one (the shares reported stay as measured)."""


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


def classify(evidence: StepEvidence, thresholds: Thresholds = DEFAULT) -> Verdict:
    """Classify one step (docs/architecture.md §7): primary wall, confidence, time shares,
    flags and a hint."""
    th = thresholds
    step, gpu, device, standing = evidence.step, evidence.gpu, evidence.device, evidence.standing
    measured = phase_fractions(step)
    fractions = measured if measured is not None else {k: 0.0 for k in FRACTION_KEYS}
    if measured is None:
        fractions["other"] = 1.0
    shares = _shares(evidence, measured, th)
    comm = fractions["comm"]
    missing = {
        "phases": measured is None,
        "window": gpu is None,
        "gpm": gpu is None or not gpu.has_gpm,
        "flops": shares.mfu is None,
        "peers": standing.score is None,
        "samples": gpu is not None and gpu.sample_count < 2,
    }

    primary, strength, moderate = Bottleneck.UNKNOWN, UNKNOWN_STRENGTH, False
    fired = _strongest(RULES, shares, th)
    if fired is None and gpu is not None:
        # No rule fired outright, and the GPU was seen not to be the explanation: a moderate
        # input or communication share, if any, is the best one left (the larger of the
        # two). Without a GPU window a moderate share is no evidence (a fast CPU step with a
        # small data wait would otherwise read as input-bound): the verdict stays unknown.
        fired = _largest_moderate(shares, th)
        moderate = fired is not None
    if fired is not None:
        primary, strength = fired

    slower_rank = standing.slower_rank
    waiting_on = None
    if primary is Bottleneck.COMMUNICATION and slower_rank is not None \
            and slower_rank.rank != step.rank:
        # Waiting on a peer is established by the comparison itself: link figures add nothing.
        waiting_on = slower_rank.rank
        hint = WAITING_HINT.format(
            rank=slower_rank.rank, silent=", which stopped reporting" if slower_rank.silent else "")
    elif primary is Bottleneck.COMMUNICATION and shares.bubble is not None \
            and shares.bubble >= comm / 2:
        # Most of the wait is for a neighbouring stage's activations or gradients: the
        # pipeline's balance, not the links, is what to change.
        hint = BUBBLE_HINT.format(share=shares.bubble)
    elif primary is Bottleneck.COMMUNICATION:
        hint, link_known = _comm_hint(gpu, comm, device.peak_nvlink_bytes_per_second, th)
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

    flags = _flags(evidence, th)
    cause = None
    for flag in (Flag.MEMORY_PRESSURE, Flag.THROTTLED, Flag.STRAGGLER):
        if flag in flags:
            remedy = evidence.memory_remedy if flag is Flag.MEMORY_PRESSURE else None
            hint += "; " + (f"memory pressure — {remedy}" if remedy else FLAG_HINTS[flag.value])
    if Flag.STRAGGLER in flags:
        cause = standing.cause or StragglerCause.UNKNOWN
        hint += f"; cause: {cause.value} — {CAUSE_HINTS[cause.value]}"
    return Verdict(primary, confidence, fractions, frozenset(flags), hint, shares.mfu, cause,
                   waiting_on, shares.bubble)


def _shares(evidence: StepEvidence, measured: Mapping[str, float] | None,
            th: Thresholds) -> Shares:
    step, gpu, device = evidence.step, evidence.gpu, evidence.device
    data = measured["input"] if measured is not None else None
    comm = measured["comm"] if measured is not None else None
    recent = evidence.recent_comm
    rule_comm = comm if comm is None or not recent \
        else min(comm, statistics.median([*recent, comm]))
    peak_flops = device.peak_flops
    step_mfu = None
    if (step.flops is not None and math.isfinite(step.flops) and step.flops >= 0
            and peak_flops is not None and peak_flops > 0 and step.duration_s > 0):
        step_mfu = mfu(step.flops, step.duration_s, peak_flops)
    busy = _busy_excluding_waits(gpu, data or 0.0, comm or 0.0)
    dram = gpu.dram_active_ratio if gpu is not None else None
    bubble = None
    if step.comm is not None and step.comm.bubble_s is not None and step.duration_s > 0:
        bubble = min(1.0, min(step.comm.bubble_s, step.comm.exposed_s) / step.duration_s)
    return Shares(
        data=data, comm=rule_comm, bubble=bubble, busy=busy,
        gpu_busy=busy is None or busy >= th.host_busy_max,
        sm=gpu.sm_active_ratio if gpu is not None else None,
        tensor=gpu.tensor_active_ratio if gpu is not None else None,
        dram=dram, mfu=step_mfu,
        below_ridge=_roofline_memory_bound(step, dram, peak_flops,
                                           device.peak_dram_bytes_per_second, th))


def _strongest(rules: Sequence[Rule], shares: Shares,
               th: Thresholds) -> tuple[Bottleneck, float] | None:
    """The first wall (in the table's order) one of whose rows fired, with the strongest of
    its rows' strengths."""
    for wall, rows in itertools.groupby(rules, key=lambda rule: rule.wall):
        strengths = [s for rule in rows if (s := rule.strength(shares, th)) is not None]
        if strengths:
            return wall, max(strengths)
    return None


def _largest_moderate(shares: Shares, th: Thresholds) -> tuple[Bottleneck, float] | None:
    """Of the moderate rows that fired, the one reading the largest share."""
    fired = [(rule.reads(shares, th) or 0.0, rule.wall, strength) for rule in MODERATE_RULES
             if (strength := rule.strength(shares, th)) is not None]
    if not fired:
        return None
    _, wall, strength = max(fired, key=lambda f: f[0])
    return wall, strength


def _flags(evidence: StepEvidence, th: Thresholds) -> set[Flag]:
    step, gpu = evidence.step, evidence.gpu
    previous = evidence.previous_mem
    previous_ooms = previous.ooms if previous is not None else None
    previous_alloc_retries = previous.alloc_retries if previous is not None else None
    flags: set[Flag] = set()
    total = evidence.device.memory_total_bytes
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
    if evidence.standing.cause is not None:
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
