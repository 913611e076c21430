"""The shared memory model: ZeRO sharding, the projection of a measured breakdown, and which
component an out-of-memory warning names."""

from __future__ import annotations

import pytest

from gpumon.analysis.estimate import estimate_memory
from gpumon.analysis.memory import (
    GROWTH_SHARE,
    REMEDIES,
    ModelStates,
    attribute_growth,
    breakdown_total,
    model_states,
    project_zero,
    shard_model_states,
)
from gpumon.wire import MemoryBreakdown

GB = 10**9
MIB = 2**20


def test_model_states_of_the_classic_7b_case() -> None:
    states = model_states(7 * 10**9, precision="fp16", optimizer="adam", master_weights=False)
    assert states == ModelStates(14 * GB, 14 * GB, 56 * GB, 0)
    k12 = model_states(7 * 10**9, precision="bf16", optimizer="adamw", master_weights=True)
    assert k12.optimizer_states + k12.master_weights == 12 * 7 * 10**9


@pytest.mark.parametrize(
    ("stage", "expected"),
    [(0, (100, 100, 800, 400)), (1, (100, 100, 100, 50)), (2, (100, 13, 100, 50)),
     (3, (13, 13, 100, 50))],
)
def test_shard_model_states_by_stage(stage: int, expected: tuple[int, ...]) -> None:
    held = shard_model_states(ModelStates(100, 100, 800, 400), stage, 8)
    assert (held.parameters, held.gradients, held.optimizer_states,
            held.master_weights) == expected


@pytest.mark.parametrize(("stage", "dp"), [(4, 2), (-1, 2), (1, 0)])
def test_shard_model_states_rejects(stage: int, dp: int) -> None:
    with pytest.raises(ValueError):
        shard_model_states(ModelStates(1, 1, 1), stage, dp)


def test_estimator_and_projection_agree_on_the_same_model() -> None:
    # A measured 1B-parameter bf16 model with Adam and fp32 masters (counted as optimizer
    # states, K = 12) projects exactly as the estimator computes the same setup.
    psi = 10**9
    measured = MemoryBreakdown(parameters=2 * psi, gradients=2 * psi,
                               optimizer_states=12 * psi, activations=5 * GB, other=GB)
    for projection in project_zero(measured, world=4):
        est = estimate_memory(psi, precision="bf16", optimizer="adam", master_weights=True,
                              zero_stage=projection.stage, gpus=projection.gpus,
                              buffers_bytes=0)
        assert (projection.parameters + projection.gradients + projection.optimizer_states
                == est.model_states_bytes)
        assert projection.activations == 5 * GB and projection.other == GB


def test_projection_covers_three_stages_at_one_two_and_four_times_the_world() -> None:
    measured = MemoryBreakdown(parameters=800, gradients=800, optimizer_states=1600,
                               activations=50, other=10)
    got = {(p.stage, p.gpus): p.total for p in project_zero(measured, world=2)}
    assert set(got) == {(s, g) for s in (1, 2, 3) for g in (2, 4, 8)}
    assert got[(1, 2)] == 800 + 800 + 800 + 60
    assert got[(2, 8)] == 800 + 100 + 200 + 60
    assert got[(3, 8)] == 100 + 100 + 200 + 60
    with pytest.raises(ValueError):
        project_zero(measured, world=0)


def test_projection_treats_absent_parts_as_zero() -> None:
    (first, *_) = project_zero(MemoryBreakdown(parameters=400), world=1, scales=(1,))
    assert first.total == 400 and first.optimizer_states == 0


def _b(**parts: int) -> MemoryBreakdown:
    base = {"parameters": 400 * MIB, "gradients": 400 * MIB, "optimizer_states": 800 * MIB,
            "activations": 1000 * MIB, "other": 100 * MIB}
    return MemoryBreakdown(**{**base, **parts})


@pytest.mark.parametrize(
    ("samples", "component", "cause"),
    [
        # Sequence length growing: activations rise, the rest stays.
        ([_b(activations=1000 * MIB), _b(activations=1500 * MIB), _b(activations=2200 * MIB)],
         "activations", "growing"),
        # A leak: what no named part explains keeps rising.
        ([_b(other=100 * MIB), _b(other=400 * MIB), _b(other=900 * MIB)], "other", "growing"),
        # The optimizer's states appear at its first step.
        ([_b(optimizer_states=0), _b(), _b()], "optimizer_states", "appeared"),
        # Absent at first (not measured yet) counts as appearing too.
        ([MemoryBreakdown(parameters=400 * MIB, gradients=400 * MIB, activations=1000 * MIB,
                          other=100 * MIB), _b()],
         "optimizer_states", "appeared"),
        # Nothing grows: the largest part is named.
        ([_b(), _b(), _b()], "activations", "largest"),
        # Growth under the noise line is no growth.
        ([_b(other=100 * MIB), _b(other=120 * MIB)], "activations", "largest"),
        # One sample: only the largest can be named.
        ([_b(optimizer_states=5000 * MIB)], "optimizer_states", "largest"),
        # Gradients of newly unfrozen layers.
        ([_b(gradients=0 + 100 * MIB), _b(gradients=400 * MIB)], "gradients", "growing"),
    ],
)
def test_attribute_growth_names_the_component(samples: list[MemoryBreakdown], component: str,
                                              cause: str) -> None:
    got = attribute_growth([(float(i), s) for i, s in enumerate(samples)])
    assert got is not None
    assert (got.component, got.cause) == (component, cause)
    assert got.remedy == REMEDIES[component]
    assert component in got.text and got.remedy in got.text


def test_attribute_growth_bytes_and_threshold() -> None:
    first, last = _b(), _b(activations=1000 * MIB + 200 * MIB)
    got = attribute_growth([(0.0, first), (1.0, last)])
    assert got is not None and got.bytes == 200 * MIB
    assert 200 * MIB >= GROWTH_SHARE * breakdown_total(last)


def test_attribute_growth_without_measurement() -> None:
    assert attribute_growth([]) is None
    assert attribute_growth([(0.0, MemoryBreakdown())]) is None


def test_remedies_follow_the_sharding_table() -> None:
    assert "ZeRO stage 1" in REMEDIES["optimizer_states"]
    assert "ZeRO stage 2" in REMEDIES["gradients"]
    assert "ZeRO stage 3" in REMEDIES["parameters"] and "model parallel" in REMEDIES["parameters"]
    assert "checkpointing" in REMEDIES["activations"]
    assert "micro-batch" in REMEDIES["activations"]
    assert "expandable_segments" in REMEDIES["other"] and "leak" in REMEDIES["other"]
