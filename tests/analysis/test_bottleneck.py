"""The bottleneck classifier: every rule, its boundaries, missing inputs and flags.

Measured communication and the straggler comparison have their own tables
(tests/analysis/test_comm.py, tests/analysis/test_straggler.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.analysis.bottleneck import (
    DEFAULT,
    FRACTION_KEYS,
    Bottleneck,
    DeviceSpec,
    Flag,
    StepEvidence,
    Thresholds,
    Verdict,
    classify,
    phase_fractions,
)
from gpumon.analysis.straggler import Standing, StragglerCause
from gpumon.analysis.window import GpuWindow
from gpumon.wire import CollectiveOp, CommStats, MemoryStats, StepRecord

PEAK = 989e12  # H100 SXM dense bf16
HBM = 3.35e12
NVLINK = 450e9
TOTAL = 80 * 10**9

# A healthy step: 1 s, no data wait, no exposed communication.
BASE_PHASES = {"forward": 0.35, "backward": 0.45, "optimizer": 0.1}
# A saturated GPU (GPM present).
SATURATED = {"utilization_ratio": 0.99, "sm_active_ratio": 0.9, "tensor_active_ratio": 0.7,
             "dram_active_ratio": 0.3}
# Busy but neither compute- nor bandwidth-saturated: no GPU rule fires.
MIDDLING = {"utilization_ratio": 0.95, "sm_active_ratio": 0.65, "tensor_active_ratio": 0.35,
            "dram_active_ratio": 0.3}


def make_step(phases: dict[str, float] | None = None, *, duration_s: float = 1.0,
              flops: float | None = None, mem: MemoryStats | None = None,
              world: int | None = 8) -> StepRecord:
    return StepRecord(run="r", rank=0, step=1, duration_s=duration_s, world=world, t_start=0.0,
                      phases_s=dict(BASE_PHASES if phases is None else phases), flops=flops,
                      mem=mem)


def with_phases(**changes: float) -> dict[str, float]:
    """BASE_PHASES with some phases set; forward shrinks so the phases stay inside the 1 s step
    (with 10 ms unattributed, so float rounding cannot push their sum past the duration)."""
    phases = dict(BASE_PHASES, **changes)
    phases["forward"] = max(0.0, 0.99 - sum(v for k, v in phases.items() if k != "forward"))
    return phases


def make_window(fields: dict[str, Any] | None = None, **more: Any) -> GpuWindow:
    values = dict(SATURATED if fields is None else fields, **more)
    values.setdefault("sample_count", 5)
    return GpuWindow(t0=0.0, t1=1.0, **values)


H100 = DeviceSpec(peak_flops=PEAK, memory_total_bytes=TOTAL, peak_dram_bytes_per_second=HBM,
                  peak_nvlink_bytes_per_second=NVLINK)


def evidence(step: StepRecord, gpu: GpuWindow | None, *, straggler_score: float | None = 1.0,
             straggler_cause: StragglerCause | None = None,
             previous_alloc_retries: int | None = None, previous_ooms: int | None = None,
             **device: Any) -> StepEvidence:
    """``step`` on an H100 (``device`` overrides its figures) beside a peer like it."""
    previous = None
    if previous_alloc_retries is not None or previous_ooms is not None:
        previous = MemoryStats(alloc_retries=previous_alloc_retries, ooms=previous_ooms)
    return StepEvidence(step, gpu, device=dataclasses.replace(H100, **device),
                        standing=Standing(straggler_score, straggler_cause),
                        previous_mem=previous)


def run(step: StepRecord, gpu: GpuWindow | None, *, thresholds: Thresholds = DEFAULT,
        **kw: Any) -> Verdict:
    return classify(evidence(step, gpu, **kw), thresholds)


def mfu_flops(ratio: float) -> float:
    return ratio * PEAK  # over a 1 s step


RULE_CASES = [
    # --- rule 2, input (data-wait share ≥ 0.20; moderate from 0.05) ---
    ("input at threshold", make_step(with_phases(data=0.20)), make_window(), {},
     Bottleneck.INPUT),
    ("input just below: GPU rule wins", make_step(with_phases(data=0.199)), make_window(), {},
     Bottleneck.COMPUTE),
    ("moderate input, nothing else fires", make_step(with_phases(data=0.10)),
     make_window(MIDDLING), {}, Bottleneck.INPUT),
    ("input below moderate", make_step(with_phases(data=0.049)), make_window(MIDDLING), {},
     Bottleneck.UNKNOWN),
    ("input outranks communication", make_step(with_phases(data=0.25, comm=0.3)),
     make_window(), {}, Bottleneck.INPUT),
    ("data timed outside the step still a share", make_step(
        {"data": 0.5, "forward": 0.4, "backward": 0.5, "optimizer": 0.1}), make_window(), {},
     Bottleneck.INPUT),
    # --- rule 3, communication (exposed share ≥ 0.15; moderate from 0.05) ---
    ("comm at threshold", make_step(with_phases(comm=0.15)), make_window(), {},
     Bottleneck.COMMUNICATION),
    ("comm just below: GPU rule wins", make_step(with_phases(comm=0.149)), make_window(), {},
     Bottleneck.COMPUTE),
    ("moderate comm, nothing else fires", make_step(with_phases(comm=0.10)),
     make_window(MIDDLING), {}, Bottleneck.COMMUNICATION),
    ("larger moderate share wins", make_step(with_phases(data=0.08, comm=0.12)),
     make_window(MIDDLING), {}, Bottleneck.COMMUNICATION),
    # --- rule 4, host (busy < 0.5 not explained by input/comm) ---
    ("host: SM activity just below", make_step(), make_window(
        {"utilization_ratio": 1.0, "sm_active_ratio": 0.49, "tensor_active_ratio": 0.1,
         "dram_active_ratio": 0.1}), {}, Bottleneck.HOST),
    ("host: SM activity at threshold is not host", make_step(), make_window(
        {"utilization_ratio": 1.0, "sm_active_ratio": 0.5, "tensor_active_ratio": 0.1,
         "dram_active_ratio": 0.1}), {}, Bottleneck.UNKNOWN),
    ("host without GPM: utilisation just below", make_step(),
     make_window({"utilization_ratio": 0.49}), {}, Bottleneck.HOST),
    ("no GPM: utilisation at threshold is not host", make_step(),
     make_window({"utilization_ratio": 0.5}), {}, Bottleneck.UNKNOWN),
    # busy over the non-waiting 90%: 0.46 / 0.9 = 0.51, 0.44 / 0.9 = 0.49
    ("idle explained by a moderate data wait", make_step(with_phases(data=0.10)),
     make_window({"utilization_ratio": 0.46}), {}, Bottleneck.INPUT),
    ("idle beyond the data wait is host", make_step(with_phases(data=0.10)),
     make_window({"utilization_ratio": 0.44}), {}, Bottleneck.HOST),
    # (0.54 − 0.10) / 0.9 = 0.49, (0.56 − 0.10) / 0.9 = 0.51
    ("NCCL kernels count as busy to NVML: subtracted", make_step(with_phases(comm=0.10)),
     make_window({"utilization_ratio": 0.54}), {}, Bottleneck.HOST),
    ("...just enough busy beyond comm", make_step(with_phases(comm=0.10)),
     make_window({"utilization_ratio": 0.56}), {}, Bottleneck.COMMUNICATION),
    # --- rule 5, memory bandwidth (DRAM ≥ 0.6 and tensor < 0.3, or roofline) ---
    ("GPM DRAM at threshold", make_step(), make_window(
        {"sm_active_ratio": 0.85, "tensor_active_ratio": 0.29, "dram_active_ratio": 0.6}), {},
     Bottleneck.MEMORY_BANDWIDTH),
    ("GPM DRAM just below", make_step(), make_window(
        {"sm_active_ratio": 0.85, "tensor_active_ratio": 0.29, "dram_active_ratio": 0.59}), {},
     Bottleneck.UNKNOWN),
    ("tensor at its maximum is not bandwidth", make_step(), make_window(
        {"sm_active_ratio": 0.85, "tensor_active_ratio": 0.3, "dram_active_ratio": 0.7}), {},
     Bottleneck.UNKNOWN),
    ("roofline: intensity under the ridge (MFU 0.1 < DRAM 0.45)",
     make_step(flops=mfu_flops(0.10)), make_window(
         {"sm_active_ratio": 0.85, "tensor_active_ratio": 0.35, "dram_active_ratio": 0.45}), {},
     Bottleneck.MEMORY_BANDWIDTH),
    ("roofline, but far from the bandwidth roof", make_step(flops=mfu_flops(0.10)),
     make_window({"sm_active_ratio": 0.85, "tensor_active_ratio": 0.35,
                  "dram_active_ratio": 0.39}), {}, Bottleneck.UNKNOWN),
    ("above the ridge (MFU 0.46 > DRAM 0.45) is compute", make_step(flops=mfu_flops(0.46)),
     make_window({"sm_active_ratio": 0.85, "tensor_active_ratio": 0.35,
                  "dram_active_ratio": 0.45}), {}, Bottleneck.COMPUTE),
    ("roofline needs the DRAM peak", make_step(flops=mfu_flops(0.10)), make_window(
        {"sm_active_ratio": 0.85, "tensor_active_ratio": 0.35, "dram_active_ratio": 0.45}),
     {"peak_dram_bytes_per_second": None}, Bottleneck.UNKNOWN),
    # --- rule 6, compute (SM ≥ 0.8 and tensor ≥ 0.5, or MFU ≥ 0.35) ---
    ("GPM compute at thresholds", make_step(), make_window(
        {"sm_active_ratio": 0.8, "tensor_active_ratio": 0.5, "dram_active_ratio": 0.3}), {},
     Bottleneck.COMPUTE),
    ("SM just below", make_step(), make_window(
        {"sm_active_ratio": 0.79, "tensor_active_ratio": 0.5, "dram_active_ratio": 0.3}), {},
     Bottleneck.UNKNOWN),
    ("tensor just below", make_step(), make_window(
        {"sm_active_ratio": 0.8, "tensor_active_ratio": 0.49, "dram_active_ratio": 0.3}), {},
     Bottleneck.UNKNOWN),
    ("MFU at threshold, no GPU window", make_step(flops=mfu_flops(0.35)), None, {},
     Bottleneck.COMPUTE),
    ("MFU just below, no GPU window", make_step(flops=mfu_flops(0.349)), None, {},
     Bottleneck.UNKNOWN),
    ("MFU needs a peak", make_step(flops=mfu_flops(0.5)), None, {"peak_flops": None},
     Bottleneck.UNKNOWN),
    # --- rule 7 ---
    ("nothing at all", make_step({}), None,
     {"peak_flops": None, "memory_total_bytes": None, "straggler_score": None},
     Bottleneck.UNKNOWN),
]


@pytest.mark.parametrize(("name", "step", "gpu", "kw", "expected"), RULE_CASES,
                         ids=[c[0] for c in RULE_CASES])
def test_rules(name: str, step: StepRecord, gpu: GpuWindow | None, kw: dict[str, Any],
               expected: Bottleneck) -> None:
    verdict = run(step, gpu, **kw)
    assert verdict.primary is expected
    assert 0.0 <= verdict.confidence <= 1.0
    assert verdict.hint


def test_moderate_verdicts_are_weaker_and_say_so() -> None:
    strong = run(make_step(with_phases(data=0.30)), make_window())
    moderate = run(make_step(with_phases(data=0.10)), make_window(MIDDLING))
    assert moderate.primary is strong.primary is Bottleneck.INPUT
    assert moderate.confidence < 0.5 <= strong.confidence
    assert moderate.hint.startswith("moderately input-bound")


def test_stronger_evidence_gives_higher_confidence() -> None:
    confidences = [run(make_step(with_phases(data=d)), make_window()).confidence
                   for d in (0.2, 0.3, 0.5)]
    assert confidences == sorted(confidences)
    assert confidences[0] < confidences[-1]


@pytest.mark.parametrize(
    ("nvlink_tx", "peak", "expected_phrase"),
    [
        (0.7 * NVLINK * 0.2, NVLINK, "near peak"),  # 70% of the link during a 20% comm phase
        (0.1 * NVLINK * 0.2, NVLINK, "far from peak"),
        (0.7 * NVLINK * 0.2, None, "throughput unknown"),
        (None, NVLINK, "throughput unknown"),
    ],
)
def test_communication_bandwidth_versus_latency(
    nvlink_tx: float | None, peak: float | None, expected_phrase: str
) -> None:
    verdict = run(make_step(with_phases(comm=0.2)),
                  make_window(nvlink_tx_bytes_per_second=nvlink_tx),
                  peak_nvlink_bytes_per_second=peak)
    assert verdict.primary is Bottleneck.COMMUNICATION
    assert expected_phrase in verdict.hint


@pytest.mark.parametrize(
    ("primary", "phrase"),
    [
        (Bottleneck.INPUT, "more DataLoader workers"),
        (Bottleneck.HOST, "CUDA graphs"),
        (Bottleneck.MEMORY_BANDWIDTH, "operator fusion"),
        (Bottleneck.COMPUTE, "mixed precision"),
    ],
)
def test_hints_follow_the_seed_mitigations(primary: Bottleneck, phrase: str) -> None:
    cases = {c[4]: c for c in RULE_CASES}
    _, step, gpu, kw, _ = cases[primary]
    assert phrase in run(step, gpu, **kw).hint


def test_unknown_names_the_largest_shares() -> None:
    verdict = run(make_step({"forward": 0.2, "backward": 0.3, "checkpoint": 0.5}),
                  make_window(MIDDLING))
    assert verdict.primary is Bottleneck.UNKNOWN
    assert "other 50%" in verdict.hint and "compute 50%" in verdict.hint


FLAG_CASES = [
    ("peak at 90% of memory", dict(mem=MemoryStats(peak_bytes=int(0.90 * TOTAL))), {},
     {Flag.MEMORY_PRESSURE}),
    ("peak just under 90%", dict(mem=MemoryStats(peak_bytes=int(0.899 * TOTAL))), {}, set()),
    ("an OOM so far", dict(mem=MemoryStats(ooms=1)), {}, {Flag.MEMORY_PRESSURE}),
    ("an old OOM, none new", dict(mem=MemoryStats(ooms=1)), {"previous_ooms": 1}, set()),
    ("a new OOM", dict(mem=MemoryStats(ooms=2)), {"previous_ooms": 1}, {Flag.MEMORY_PRESSURE}),
    ("allocator retries rising", dict(mem=MemoryStats(alloc_retries=5)),
     {"previous_alloc_retries": 4}, {Flag.MEMORY_PRESSURE}),
    ("allocator retries flat", dict(mem=MemoryStats(alloc_retries=5)),
     {"previous_alloc_retries": 5}, set()),
    ("retries without a previous count", dict(mem=MemoryStats(alloc_retries=5)), {}, set()),
    ("the run's straggler", {}, {"straggler_score": 0.6,
                                 "straggler_cause": StragglerCause.COMPUTE}, {Flag.STRAGGLER}),
    # The comparison weighs more than the score (share of the step, persistence).
    ("a low score the comparison did not flag", {}, {"straggler_score": 0.6}, set()),
]


@pytest.mark.parametrize(("name", "step_kw", "kw", "expected"), FLAG_CASES,
                         ids=[c[0] for c in FLAG_CASES])
def test_flags(name: str, step_kw: dict[str, Any], kw: dict[str, Any],
               expected: set[Flag]) -> None:
    verdict = run(make_step(**step_kw), make_window(), **kw)
    assert verdict.flags == frozenset(expected)
    assert verdict.primary is Bottleneck.COMPUTE  # flags never change the primary


def test_memory_pressure_falls_back_to_nvml_and_its_total() -> None:
    gpu = make_window(memory_used_bytes_max=95, memory_total_bytes=100)
    assert Flag.MEMORY_PRESSURE in run(make_step(), gpu, memory_total_bytes=None).flags
    assert Flag.MEMORY_PRESSURE not in run(make_step(), make_window(memory_used_bytes_max=89,
                                                                    memory_total_bytes=100),
                                           memory_total_bytes=None).flags


def test_memory_pressure_hint_says_batch_only_shrinks_activations() -> None:
    verdict = run(make_step(mem=MemoryStats(ooms=1)), make_window())
    assert "ZeRO" in verdict.hint and "shrinks only activations" in verdict.hint


@pytest.mark.parametrize(
    ("fractions", "thresholds", "flagged"),
    [
        ({"hw_thermal_slowdown": 0.2}, DEFAULT, True),
        ({"sw_thermal_slowdown": 1.0}, DEFAULT, True),
        ({"hw_power_brake_slowdown": 0.5}, DEFAULT, True),
        ({"hw_thermal_slowdown": 0.0, "gpu_idle": 1.0}, DEFAULT, False),
        ({"sw_power_cap": 1.0}, DEFAULT, False),  # normal at full load
        ({"sw_power_cap": 1.0},
         dataclasses.replace(DEFAULT, throttle_reasons=frozenset({"sw_power_cap"})), True),
    ],
)
def test_throttled_from_clock_event_reasons(
    fractions: dict[str, float], thresholds: Thresholds, flagged: bool
) -> None:
    verdict = run(make_step(), make_window(clock_event_fractions=fractions),
                  thresholds=thresholds)
    assert (Flag.THROTTLED in verdict.flags) is flagged


def test_thresholds_are_overridable() -> None:
    step, gpu = make_step(with_phases(data=0.25)), make_window(MIDDLING)
    assert run(step, gpu).primary is Bottleneck.INPUT
    lenient = dataclasses.replace(DEFAULT, input_high_fraction=0.3)
    verdict = run(step, gpu, thresholds=lenient)
    assert verdict.primary is Bottleneck.INPUT and verdict.confidence < 0.5  # now moderate


@pytest.mark.parametrize(
    "changes",
    [{"input_high_fraction": 1.5}, {"host_busy_max": -0.1},
     {"input_moderate_fraction": 0.3, "input_high_fraction": 0.2},
     {"comm_moderate_fraction": 0.2, "comm_high_fraction": 0.1}],
)
def test_impossible_thresholds_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Thresholds(**changes)


# Each pair: the same situation with one input missing gives the same primary, less sure.
HOST_GPM = make_window({"utilization_ratio": 1.0, "sm_active_ratio": 0.3,
                        "tensor_active_ratio": 0.05, "dram_active_ratio": 0.1})
MISSING_CASES: list[tuple[str, Any, Any]] = [
    ("no GPM", (make_step(), HOST_GPM, {}),
     (make_step(), make_window({"utilization_ratio": 0.3}), {})),
    ("no phases", (make_step(), HOST_GPM, {}), (make_step({}), HOST_GPM, {})),
    ("no flops", (make_step(flops=mfu_flops(0.4)), make_window(), {}),
     (make_step(), make_window(), {})),
    ("no peak FLOP/s", (make_step(flops=mfu_flops(0.4)), make_window(), {}),
     (make_step(flops=mfu_flops(0.4)), make_window(), {"peak_flops": None})),
    ("no GPU window", (make_step(with_phases(data=0.3)), make_window(), {}),
     (make_step(with_phases(data=0.3)), None, {})),
    ("no GPM for MFU-only compute", (make_step(flops=mfu_flops(0.5)), make_window(), {}),
     (make_step(flops=mfu_flops(0.5)), None, {})),
    ("single sample in the window", (make_step(), HOST_GPM, {}),
     (make_step(), dataclasses.replace(HOST_GPM, sample_count=1), {})),
    ("no peer ranks (single GPU)", (make_step(with_phases(comm=0.3)), make_window(), {}),
     (make_step(with_phases(comm=0.3), world=1), make_window(), {"straggler_score": None})),
    ("no link counters", (make_step(with_phases(comm=0.3)),
                          make_window(nvlink_tx_bytes_per_second=1e9), {}),
     (make_step(with_phases(comm=0.3)), make_window(), {})),
    ("everything missing", (make_step(with_phases(data=0.3)), make_window(MIDDLING), {}),
     (make_step(with_phases(data=0.3)), None,
      {"peak_flops": None, "straggler_score": None, "memory_total_bytes": None})),
]


def test_moderate_share_needs_a_gpu_window() -> None:
    """A 10% data wait is the best guess when the GPU was seen to be middling; with no GPU
    window at all (a CPU-only job) it is no evidence, and the verdict stays unknown."""
    step = make_step(with_phases(data=0.1))
    assert run(step, make_window(MIDDLING)).primary is Bottleneck.INPUT
    blind = run(step, None, peak_flops=None, straggler_score=None, memory_total_bytes=None)
    assert blind.primary is Bottleneck.UNKNOWN
    assert "input 10%" in blind.hint


@pytest.mark.parametrize(("name", "full", "lacking"), MISSING_CASES,
                         ids=[c[0] for c in MISSING_CASES])
def test_missing_inputs_lower_confidence(
    name: str, full: tuple[StepRecord, GpuWindow | None, dict[str, Any]],
    lacking: tuple[StepRecord, GpuWindow | None, dict[str, Any]],
) -> None:
    a = run(full[0], full[1], **full[2])
    b = run(lacking[0], lacking[1], **lacking[2])
    assert a.primary is b.primary
    assert b.confidence < a.confidence


def test_single_gpu_without_communication_loses_nothing() -> None:
    step = make_step(world=1)
    a = run(step, make_window(), straggler_score=1.0)
    b = run(step, make_window(), straggler_score=None)
    assert a.primary is b.primary is Bottleneck.COMPUTE
    assert b.confidence <= a.confidence


def test_fractions_and_mfu_in_the_verdict() -> None:
    verdict = run(make_step({"data": 0.1, "forward": 0.3, "backward": 0.4, "comm": 0.05,
                             "optimizer": 0.1, "logging": 0.02}, flops=mfu_flops(0.4)),
                  make_window())
    assert verdict.fractions == pytest.approx(
        {"input": 0.1, "compute": 0.7, "comm": 0.05, "optimizer": 0.1, "other": 0.05})
    assert verdict.mfu == pytest.approx(0.4)


def test_phase_fractions_without_phases() -> None:
    assert phase_fractions(make_step({})) is None
    assert phase_fractions(make_step({"forward": 0.0})) is None
    verdict = run(make_step({}), None)
    assert verdict.fractions == {"input": 0.0, "compute": 0.0, "comm": 0.0, "optimizer": 0.0,
                                 "other": 1.0}


def test_enum_values_are_the_contract() -> None:
    assert [b.value for b in Bottleneck] == [
        "input", "host", "communication", "memory_bandwidth", "compute", "unknown"]
    assert [f.value for f in Flag] == ["memory_pressure", "throttled", "straggler"]


# ---------------------------------------------------------------- property: never raises

ratios = st.none() | st.floats(0.0, 1.0)
seconds = st.floats(0.0, 1000.0)
phase_names = st.sampled_from(["data", "forward", "backward", "comm", "optimizer", "eval"])
steps = st.builds(
    StepRecord,
    run=st.just("r"), rank=st.integers(0, 7), step=st.integers(0, 10**6),
    duration_s=st.floats(0.0, 86_399.0),
    world=st.none() | st.integers(1, 1024),
    phases_s=st.dictionaries(phase_names, seconds, max_size=6),
    flops=st.none() | st.floats(0.0, 1e18),
    mem=st.none() | st.builds(
        MemoryStats,
        allocated_bytes=st.none() | st.integers(0, 2**40),
        reserved_bytes=st.none() | st.integers(0, 2**40),
        peak_bytes=st.none() | st.integers(0, 2**40),
        alloc_retries=st.none() | st.integers(0, 10**6),
        ooms=st.none() | st.integers(0, 100),
    ),
    comm=st.none() | st.builds(
        CommStats, exposed_s=seconds, busy_s=seconds,
        ops=st.lists(st.builds(CollectiveOp, name=st.sampled_from(["all_reduce", "broadcast"]),
                               count=st.integers(0, 1000), bytes=st.integers(0, 2**40),
                               seconds=seconds), max_size=2).map(tuple)),
)
windows = st.none() | st.builds(
    GpuWindow,
    t0=st.just(0.0), t1=st.just(1.0), sample_count=st.integers(1, 100),
    utilization_ratio=ratios, sm_active_ratio=ratios, tensor_active_ratio=ratios,
    dram_active_ratio=ratios,
    nvlink_tx_bytes_per_second=st.none() | st.floats(0.0, 1e12),
    nvlink_rx_bytes_per_second=st.none() | st.floats(0.0, 1e12),
    memory_used_bytes_max=st.none() | st.integers(0, 2**40),
    memory_total_bytes=st.none() | st.integers(0, 2**40),
    clock_event_fractions=st.dictionaries(
        st.sampled_from(["hw_slowdown", "sw_power_cap", "gpu_idle"]), st.floats(0.0, 1.0)),
)
positive = st.none() | st.floats(1.0, 1e16)


@settings(max_examples=400, deadline=None)
@given(step=steps, gpu=windows, peak_flops=positive, total=st.none() | st.integers(0, 2**40),
       dram=positive, nvlink=positive, score=st.none() | st.floats(0.0, 10.0),
       previous=st.none() | st.integers(0, 10**6))
def test_any_valid_input_gives_a_bounded_verdict(
    step: StepRecord, gpu: GpuWindow | None, peak_flops: float | None, total: int | None,
    dram: float | None, nvlink: float | None, score: float | None, previous: int | None,
) -> None:
    verdict = classify(evidence(step, gpu, peak_flops=peak_flops, memory_total_bytes=total,
                                peak_dram_bytes_per_second=dram,
                                peak_nvlink_bytes_per_second=nvlink, straggler_score=score,
                                previous_alloc_retries=previous))
    assert isinstance(verdict.primary, Bottleneck)
    assert 0.0 <= verdict.confidence <= 1.0
    assert set(verdict.fractions) == set(FRACTION_KEYS)
    assert all(v >= 0.0 for v in verdict.fractions.values())
    assert sum(verdict.fractions.values()) <= 1.0 + 1e-9
    assert verdict.hint


def test_a_stage_waiting_on_its_neighbour_reads_communication_with_its_bubble() -> None:
    """A pipeline stage that spends 0.55 s of a 1 s step waiting to receive (of 0.6 s exposed)
    reads communication, its bubble share beside the verdict and a pipeline hint; a step whose
    exposed wait is a collective's keeps the link hint."""
    phases = {"forward": 0.7, "backward": 0.29}
    stage = dataclasses.replace(make_step(phases), comm=CommStats(0.6, 0.6, (), bubble_s=0.55))
    verdict = run(stage, make_window())
    assert verdict.primary is Bottleneck.COMMUNICATION
    assert verdict.bubble == pytest.approx(0.55)
    assert "pipeline stage" in verdict.hint and "55%" in verdict.hint
    collective = dataclasses.replace(make_step(phases), comm=CommStats(0.6, 0.6))
    other = run(collective, make_window())
    assert other.primary is Bottleneck.COMMUNICATION and other.bubble is None
    assert "pipeline" not in other.hint
