"""``gpumon estimate`` beside DeepSpeed's own estimators of the model states one GPU holds
(``estimate_zero2_model_states_mem_needs``, ``estimate_zero3_model_states_mem_needs``, without
offload), over a set of sizes: where they agree and why they differ (docs/deepspeed.md).

Both count 16-bit parameters (2 B), 16-bit gradients (2 B), the fp32 master copy (4 B) and
Adam's two moments (8 B), sharded as ZeRO shards them. DeepSpeed adds, at stage 2, an fp32
gradient partition (4 B a parameter over the GPUs: ZeRO-2 upcasts the reduced partition for the
optimizer step), and at stage 3 the largest layer gathered whole, parameters and gradients in
16-bit (4 B a parameter of that layer), with 2 B a parameter over the GPUs more than the 16
both count. Each relation is asserted to the byte, less each side's rounding.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the estimators need no device

from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs  # noqa: E402
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs  # noqa: E402

from gpumon.analysis.estimate import estimate_memory  # noqa: E402

SIZES = [  # parameters, the largest layer's (an embedding: vocabulary × hidden)
    (125_000_000, 50_257 * 768),
    (1_300_000_000, 50_257 * 2_048),
    (7_000_000_000, 32_000 * 4_096),
    (70_000_000_000, 32_000 * 8_192),
]
GPUS = [1, 2, 8, 64, 512]
ROUNDING_BYTES = 4
"""DeepSpeed truncates its one product; gpumon rounds each of its items up."""


@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize(("params", "largest_layer"), SIZES)
def test_stage_2_differs_by_deepspeeds_fp32_gradient_partition(params: int, largest_layer: int,
                                                                 gpus: int) -> None:
    ours = estimate_memory(params, precision="bf16", optimizer="adamw", master_weights=True,
                           zero_stage=2, gpus=gpus).model_states_bytes
    _, theirs = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus, num_nodes=1,
                                                      cpu_offload=False)
    assert abs(theirs - (ours + 4 * params / gpus)) <= ROUNDING_BYTES
    assert theirs > ours


@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize(("params", "largest_layer"), SIZES)
def test_stage_3_differs_by_the_gathered_largest_layer(params: int, largest_layer: int,
                                                        gpus: int) -> None:
    ours = estimate_memory(params, precision="bf16", optimizer="adamw", master_weights=True,
                           zero_stage=3, gpus=gpus).model_states_bytes
    _, theirs, layer_bytes = estimate_zero3_model_states_mem_needs(
        params, largest_layer, num_gpus_per_node=gpus, num_nodes=1, cpu_offload=False,
        cpu_offload_params=False)
    assert layer_bytes == 4 * largest_layer
    assert abs(theirs - (ours + layer_bytes + 2 * params / gpus)) <= ROUNDING_BYTES


@pytest.mark.parametrize(("params", "largest_layer"), SIZES)
def test_at_scale_both_stages_agree_within_the_terms_that_do_not_shrink(params: int,
                                                                        largest_layer: int) -> None:
    # Over 512 GPUs the sharded terms vanish: stage 2 agrees on the unsharded 16-bit
    # parameters; stage 3 differs by the one gathered layer.
    gpus = 512
    ours2 = estimate_memory(params, zero_stage=2, gpus=gpus).model_states_bytes
    _, theirs2 = estimate_zero2_model_states_mem_needs(params, gpus, 1, cpu_offload=False)
    assert abs(theirs2 - ours2) / ours2 < 0.02
    ours3 = estimate_memory(params, zero_stage=3, gpus=gpus).model_states_bytes
    _, theirs3, layer = estimate_zero3_model_states_mem_needs(params, largest_layer, gpus, 1,
                                                             cpu_offload=False, cpu_offload_params=False)
    assert theirs3 - ours3 >= layer
