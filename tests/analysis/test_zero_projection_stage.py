"""The ZeRO what-if of a run that already shards with ZeRO starts from its stage: the measured
share is taken back to one replica's model states, then sharded as each stage from the one in
use would shard it."""

from __future__ import annotations

import pytest

from gpumon.analysis.memory import project_zero
from gpumon.wire import MemoryBreakdown

P = 1_000_000  # parameters; fp32 with AdamW and ZeRO's fp32 master copy: 4 + 4 + 12 bytes each


def held(stage: int, world: int) -> MemoryBreakdown:
    """What one rank holds under ``stage`` over ``world`` ranks."""
    return MemoryBreakdown(parameters=4 * P // (world if stage == 3 else 1),
                           gradients=4 * P // (world if stage >= 2 else 1),
                           optimizer_states=12 * P // (world if stage >= 1 else 1),
                           activations=1000, other=10)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_stage_in_use_projects_to_what_it_measured(stage: int) -> None:
    projections = project_zero(held(stage, 4), 4, current_stage=stage)
    assert min(p.stage for p in projections) == max(stage, 1)
    same = [p for p in projections if p.stage == stage and p.gpus == 4]
    if stage:
        measured = held(stage, 4)
        assert same[0].total == sum(getattr(measured, k) for k in (
            "parameters", "gradients", "optimizer_states", "activations", "other"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_reads_the_same_whichever_stage_was_measured(stage: int) -> None:
    # A run at stage 1 and one at stage 3 of the same model project the same stage-3 figures.
    from_zero = {(p.stage, p.gpus): p.total for p in project_zero(held(0, 8), 8)}
    from_stage = {(p.stage, p.gpus): p.total for p in project_zero(held(stage, 8), 8, current_stage=stage)}
    assert from_stage == {key: total for key, total in from_zero.items() if key[0] >= stage}


def test_a_stage_that_does_not_exist_is_refused() -> None:
    with pytest.raises(ValueError, match="current_stage"):
        project_zero(held(0, 2), 2, current_stage=4)
