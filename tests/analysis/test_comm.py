"""Measured communication in the verdicts: the exposed wait, the compute share without it, a
hand-timed ``comm`` phase never added to it, and nccl-tests' bus-bandwidth factors.

The fixtures are shaped like real DDP steps on the hooks users write (forward / backward /
optimizer phases, the data wait from the loader): the exposed all-reduce wait sits inside
``backward``, where DDP puts it.
"""

from __future__ import annotations

import pytest

from gpumon.analysis.bottleneck import (
    Bottleneck,
    DeviceSpec,
    StepEvidence,
    Verdict,
    classify,
    phase_fractions,
)
from gpumon.analysis.comm import (
    attributed_phases,
    bus_bandwidth_factor,
    overlapped_s,
    wait_s,
)
from gpumon.analysis.straggler import Standing
from gpumon.analysis.window import GpuWindow, merge_steps
from gpumon.wire import CollectiveOp, CommStats, StepRecord

PEAK = 989e12
SATURATED = {"utilization_ratio": 0.99, "sm_active_ratio": 0.9, "tensor_active_ratio": 0.7,
             "dram_active_ratio": 0.3, "sample_count": 5}
GRADIENTS = 64 * 2**20  # 4 x Linear(2048, 2048) in fp32: what one step all-reduces


def ddp_step(duration_s: float, phases: dict[str, float], exposed_s: float | None,
             busy_s: float | None = None, *, rank: int = 0, buckets: int = 3) -> StepRecord:
    comm = None
    if exposed_s is not None:
        busy = exposed_s if busy_s is None else busy_s
        comm = CommStats(exposed_s, busy, (CollectiveOp("all_reduce", buckets, GRADIENTS, busy),))
    return StepRecord(run="ddp", rank=rank, step=1, duration_s=duration_s, world=2, t_start=0.0,
                      phases_s=phases, comm=comm)


def verdict(step: StepRecord, gpu: GpuWindow | None = None) -> Verdict:
    return classify(StepEvidence(step, gpu, device=DeviceSpec(peak_flops=PEAK),
                                 standing=Standing(1.0)))


# A comm-heavy DDP step as measured on 2 CPU ranks (gloo): 120 ms, of which 75 ms blocked on
# the all-reduce at the end of backward; 90 ms with a bucket in flight.
COMM_HEAVY = ddp_step(0.120, {"data": 0.002, "forward": 0.015, "backward": 0.095,
                              "optimizer": 0.006}, 0.075, 0.090)
# The same step, hooked as a user would at first: no watch(), no comm figures.
UNWATCHED = ddp_step(0.120, dict(COMM_HEAVY.phases_s), None)
# Compute-heavy DDP (small MLP, batch 512): 3 ms of a 200 ms step waits on the all-reduce.
COMPUTE_HEAVY = ddp_step(0.200, {"data": 0.002, "forward": 0.070, "backward": 0.118,
                                 "optimizer": 0.008}, 0.003, 0.040)

VERDICT_CASES = [
    ("comm-heavy DDP, no GPU window", COMM_HEAVY, None, Bottleneck.COMMUNICATION),
    ("comm-heavy DDP, busy GPU", COMM_HEAVY, GpuWindow(0.0, 1.0, **SATURATED),
     Bottleneck.COMMUNICATION),
    ("the same job unwatched: the wait reads as compute", UNWATCHED, None, Bottleneck.UNKNOWN),
    ("compute-heavy DDP", COMPUTE_HEAVY, GpuWindow(0.0, 1.0, **SATURATED), Bottleneck.COMPUTE),
    ("exposed at the threshold", ddp_step(1.0, {"forward": 0.3, "backward": 0.6}, 0.15), None,
     Bottleneck.COMMUNICATION),
    ("exposed just below, no window: nothing else fires",
     ddp_step(1.0, {"forward": 0.3, "backward": 0.6}, 0.149), None, Bottleneck.UNKNOWN),
    ("measured comm without any phases", ddp_step(0.1, {}, 0.06), None,
     Bottleneck.COMMUNICATION),
    ("input still outranks communication",
     ddp_step(0.2, {"data": 0.06, "forward": 0.02, "backward": 0.1}, 0.08), None,
     Bottleneck.INPUT),
]


@pytest.mark.parametrize(("name", "step", "gpu", "expected"), VERDICT_CASES,
                         ids=[c[0] for c in VERDICT_CASES])
def test_verdicts_use_the_measured_exposed_share(name: str, step: StepRecord,
                                                 gpu: GpuWindow | None,
                                                 expected: Bottleneck) -> None:
    assert verdict(step, gpu).primary is expected


def test_compute_share_excludes_the_time_blocked_in_collectives() -> None:
    shares = phase_fractions(COMM_HEAVY)
    assert shares is not None
    assert shares["comm"] == pytest.approx(0.075 / 0.120)
    # backward held the 75 ms wait: 15 + (95 - 75) ms of work remain
    assert shares["compute"] == pytest.approx((0.015 + 0.020) / 0.120)
    assert sum(shares.values()) == pytest.approx(1.0)
    unwatched = phase_fractions(UNWATCHED)
    assert unwatched is not None and unwatched["compute"] == pytest.approx(0.110 / 0.120)


@pytest.mark.parametrize(
    ("phases", "exposed", "expected_wait", "expected_phases"),
    [
        # a hand-timed comm phase and the measurement of the same wait: never added
        ({"forward": 0.3, "comm": 0.2, "optimizer": 0.1}, 0.18, 0.2,
         {"forward": 0.3, "comm": 0.2, "optimizer": 0.1}),
        # the measurement sees more than the hand-timed phase: the rest was inside backward
        ({"forward": 0.3, "backward": 0.4, "comm": 0.1}, 0.25, 0.25,
         {"forward": 0.3, "backward": 0.25, "comm": 0.25}),
        # no comm phase: taken out of backward first, then forward, then the optimizer step
        ({"forward": 0.2, "backward": 0.1, "optimizer": 0.1}, 0.35, 0.35,
         {"optimizer": 0.05, "comm": 0.35}),
        # a hand-timed phase alone (no watch()) still works
        ({"forward": 0.3, "comm": 0.2}, None, 0.2, {"forward": 0.3, "comm": 0.2}),
        # nothing either way
        ({"forward": 0.3}, None, None, {"forward": 0.3}),
        # a wait no phase held (the loop times no phases): it stays in the step's other time
        ({}, 0.4, 0.4, {"comm": 0.4}),
    ],
)
def test_wait_is_the_larger_of_phase_and_measurement(
    phases: dict[str, float], exposed: float | None, expected_wait: float | None,
    expected_phases: dict[str, float],
) -> None:
    step = ddp_step(1.0, phases, exposed)
    assert wait_s(step) == (pytest.approx(expected_wait) if expected_wait is not None else None)
    assert attributed_phases(step) == pytest.approx(expected_phases)


def test_a_comm_phase_and_its_measurement_give_the_same_verdict_as_either_alone() -> None:
    phases = {"forward": 0.3, "backward": 0.4, "comm": 0.25}
    both, phase_only = ddp_step(1.0, phases, 0.25), ddp_step(1.0, phases, None)
    assert verdict(both).fractions == pytest.approx(verdict(phase_only).fractions)
    assert verdict(both).fractions["comm"] == pytest.approx(0.25)


def test_overlapped_time_is_busy_beyond_the_exposed_wait() -> None:
    assert overlapped_s(COMM_HEAVY) == pytest.approx(0.015)
    assert overlapped_s(UNWATCHED) is None
    assert overlapped_s(ddp_step(1.0, {}, 0.3, 0.2)) == 0.0  # busy below exposed: none


def test_merged_steps_sum_their_communication_per_op() -> None:
    first = ddp_step(0.1, {"backward": 0.08}, 0.05, 0.07)
    second = StepRecord(run="ddp", rank=0, step=2, duration_s=0.1, world=2, t_start=0.1,
                        phases_s={"backward": 0.08},
                        comm=CommStats(0.04, 0.06, (CollectiveOp("all_reduce", 2, 10, 0.05),
                                                    CollectiveOp("broadcast", 1, 4, 0.01))))
    merged = merge_steps([first, second])
    assert merged.comm is not None
    assert merged.comm.exposed_s == pytest.approx(0.09)
    assert merged.comm.busy_s == pytest.approx(0.13)
    ops = {op.name: op for op in merged.comm.ops}
    assert (ops["all_reduce"].count, ops["all_reduce"].bytes) == (5, GRADIENTS + 10)
    assert ops["all_reduce"].seconds == pytest.approx(0.12)
    assert (ops["broadcast"].count, ops["broadcast"].bytes) == (1, 4)
    assert merge_steps([UNWATCHED, second]).comm == second.comm  # only the measured one


@pytest.mark.parametrize(
    ("op", "world", "factor"),
    [
        ("all_reduce", 2, 1.0),  # 2(n-1)/n
        ("all_reduce", 8, 1.75),
        ("reduce_scatter", 8, 0.875),  # (n-1)/n
        ("all_gather", 4, 0.75),
        ("broadcast", 8, 1.0),
        ("all_reduce", 1, 0.0),  # one rank moves nothing over a bus
        ("all_reduce", None, None),
        ("barrier", 8, None),
    ],
)
def test_bus_bandwidth_factors_are_nccl_tests(op: str, world: int | None,
                                               factor: float | None) -> None:
    assert bus_bandwidth_factor(op, world) == factor
