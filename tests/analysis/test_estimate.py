"""The memory estimator: the classic 7B case, the ZeRO paper's figures, Korthikanti activations."""

from __future__ import annotations

from typing import Any

import pytest

from gpumon.analysis.estimate import (
    DEFAULT_BUFFERS_BYTES,
    activation_bytes,
    estimate_memory,
    parse_bytes,
    parse_count,
)

GB = 10**9
CLASSIC_7B: dict[str, Any] = {"precision": "fp16", "optimizer": "adam", "master_weights": False,
                           "zero_stage": 0, "gpus": 1, "buffers_bytes": 0}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("7B", 7 * 10**9), ("7b", 7 * 10**9), ("175M", 175 * 10**6), ("1.3e9", 1_300_000_000),
     ("1.3B", 1_300_000_000), (" 13B ", 13 * 10**9), ("1T", 10**12), ("1.5k", 1500),
     ("7000000", 7_000_000), (".5B", 500_000_000), ("7G", 7 * 10**9), ("6.7B", 6_700_000_000)],
)
def test_parse_count(text: str, expected: int) -> None:
    assert parse_count(text) == expected


@pytest.mark.parametrize("text", ["", "B", "-7B", "7X", "7BB", "nan", "inf", "7 B B", "1,3B"])
def test_parse_count_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_count(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("80gib", 80 * 2**30), ("141G", 141 * 10**9),
     ("80Gi", 80 * 2**30), ("80 GB", 80 * 10**9), ("1024", 1024), ("1024B", 1024),
     ("512MiB", 512 * 2**20), ("1.5TB", 1_500_000_000_000), ("2Ki", 2048), ("24e9", 24 * 10**9)],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "80XB", "80GiBB", "80 G B", "eightyGB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_classic_7b_case_item_by_item() -> None:
    est = estimate_memory(7 * 10**9, **CLASSIC_7B, gpu_memory_bytes=80 * GB)
    assert est.params_bytes == 14 * GB
    assert est.grads_bytes == 14 * GB
    assert est.optimizer_states_bytes == 56 * GB
    assert est.master_weights_bytes == 0
    assert est.activations_bytes is None
    assert est.total_bytes == 84 * GB
    assert est.fits() is False  # "even at batch 1 ... 84 GB: still does not fit" an 80 GB A100


def test_classic_7b_with_master_weights_shows_the_fp32_copy_as_its_own_item() -> None:
    est = estimate_memory(7 * 10**9, **{**CLASSIC_7B, "master_weights": True})
    assert est.master_weights_bytes == 28 * GB
    assert est.optimizer_states_bytes == 56 * GB
    assert est.total_bytes == 112 * GB


@pytest.mark.parametrize(
    ("stage", "expected_gb"),
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_zero_paper_75b_on_64_gpus(stage: int, expected_gb: float) -> None:
    # ZeRO paper, figure 1: Ψ = 7.5B, N_d = 64, K = 12 mixed-precision Adam; model states only.
    est = estimate_memory(7_500_000_000, precision="fp16", optimizer="adam", master_weights=True,
                          zero_stage=stage, gpus=64, buffers_bytes=0)
    assert est.activations_bytes is None
    assert round(est.total_bytes / GB, 1) == expected_gb


def test_zero_stage_1_is_exactly_2psi_2psi_k_psi_over_n() -> None:
    psi, n = 7_500_000_000, 64
    est = estimate_memory(psi, precision="bf16", optimizer="adamw", master_weights=True,
                          zero_stage=1, gpus=n, buffers_bytes=0)
    assert est.total_bytes == 2 * psi + 2 * psi + 12 * psi // n


@pytest.mark.parametrize(
    ("optimizer", "precision", "master", "expected"),
    [
        ("adam", "bf16", False, (2, 2, 8, 0)),
        ("adamw", "bf16", True, (2, 2, 8, 4)),
        ("sgd_momentum", "fp16", True, (2, 2, 4, 4)),
        ("sgd", "fp16", False, (2, 2, 0, 0)),
        ("adam", "fp32", True, (4, 4, 8, 0)),  # fp32: the parameters are the master copy
    ],
)
def test_bytes_per_parameter(optimizer: str, precision: str, master: bool,
                             expected: tuple[int, int, int, int]) -> None:
    est = estimate_memory(10**9, optimizer=optimizer, precision=precision,  # type: ignore[arg-type]
                          master_weights=master)
    got = (est.params_bytes, est.grads_bytes, est.optimizer_states_bytes,
           est.master_weights_bytes)
    assert got == tuple(b * 10**9 for b in expected)


def test_tensor_parallel_splits_model_states_and_zero_shards_over_data_parallel() -> None:
    est = estimate_memory(8 * 10**9, precision="bf16", optimizer="adam", master_weights=True,
                          zero_stage=1, gpus=8, tensor_parallel=2, buffers_bytes=0)
    # per TP shard 4B params; data-parallel degree 4 shards the 12 B/param states
    assert (est.params_bytes, est.grads_bytes) == (8 * GB, 8 * GB)
    assert (est.optimizer_states_bytes, est.master_weights_bytes) == (8 * GB, 4 * GB)


# Korthikanti et al. 2022, by hand: s = 2048, b = 4, h = 1024, a = 16, L = 2.
# s·b·h = 8,388,608; 5·a·s/h = 160.
SBH = 2048 * 4 * 1024
SHAPE: dict[str, Any] = {"layers": 2, "hidden": 1024, "heads": 16, "seq": 2048, "batch": 4}


@pytest.mark.parametrize(
    ("flash", "recompute", "precision", "tp", "expected"),
    [
        (False, "none", "bf16", 1, 2 * SBH * (34 + 160)),  # 3,254,779,904
        (True, "none", "bf16", 1, 2 * SBH * 34),
        (False, "selective", "bf16", 1, 2 * SBH * 34),
        (False, "none", "fp32", 1, 2 * 2 * SBH * (34 + 160)),
        (False, "none", "bf16", 2, 2 * SBH * (10 + 24 // 2 + 160 // 2)),
        # full: each layer's input (2sbh) kept, plus one layer alive while it is recomputed
        (False, "full", "bf16", 1, 2 * 2 * SBH + SBH * (34 + 160)),
        (True, "full", "bf16", 1, 2 * 2 * SBH + SBH * 34),
    ],
)
def test_korthikanti_activations(flash: bool, recompute: str, precision: str, tp: int,
                                 expected: int) -> None:
    got = activation_bytes(**SHAPE, flash_attention=flash, recompute=recompute,  # type: ignore[arg-type]
                           precision=precision, tensor_parallel=tp)  # type: ignore[arg-type]
    assert got == expected


def test_the_hand_computed_number() -> None:
    assert activation_bytes(**SHAPE, flash_attention=False, recompute="none",
                            precision="bf16") == 3_254_779_904


def test_activations_need_the_whole_shape() -> None:
    with pytest.raises(ValueError, match="missing: heads, seq, batch"):
        estimate_memory(10**9, layers=2, hidden=1024)
    est = estimate_memory(10**9, **SHAPE)
    assert est.activations_bytes == 3_254_779_904


def test_buffers_default_is_explicit() -> None:
    est = estimate_memory(10**9)
    assert est.buffers_bytes == DEFAULT_BUFFERS_BYTES and est.buffers_default
    assert not estimate_memory(10**9, buffers_bytes=5).buffers_default


def test_plan_when_it_fits() -> None:
    est = estimate_memory(10**9, gpus=4, gpu_memory_bytes=80 * GB)
    assert est.fits() is True
    assert est.plan is not None and est.plan.fits and est.plan.memory_bytes == 80 * GB
    assert est.fits(10 * GB) is False


def test_plan_when_the_classic_7b_does_not_fit_one_gpu() -> None:
    est = estimate_memory(7 * 10**9, **CLASSIC_7B, gpu_memory_bytes=80 * GB)
    assert est.plan is not None and not est.plan.fits
    assert est.plan.zero_here is None  # one GPU: nothing to shard over
    assert [(o.stage, o.gpus) for o in est.plan.zero_from] == [(1, 2), (2, 2), (3, 2)]


def test_plan_names_the_zero_stage_that_fits_on_the_current_gpus() -> None:
    est = estimate_memory(7 * 10**9, **{**CLASSIC_7B, "gpus": 8, "master_weights": True},
                          gpu_memory_bytes=40 * GB)
    # 112 GB of model states; ZeRO-1 over 8: 28 + 12·7/8 = 38.5 GB fits 40 GB
    assert est.plan is not None and est.plan.zero_here is not None
    assert (est.plan.zero_here.stage, est.plan.zero_here.gpus) == (1, 8)
    assert est.plan.zero_here.per_gpu_bytes == 38_500_000_000


def test_plan_when_activations_alone_overflow() -> None:
    est = estimate_memory(7 * 10**9, gpus=8, layers=32, hidden=4096, heads=32, seq=4096,
                          batch=8, gpu_memory_bytes=80 * GB)
    assert est.plan is not None and est.plan.zero_here is None and est.plan.zero_from == ()


def test_without_gpu_memory_fits_is_unknown() -> None:
    est = estimate_memory(10**9)
    assert est.fits() is None
    assert est.plan is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"params": 0},
        {"precision": "fp8"},
        {"optimizer": "lion"},
        {"zero_stage": 4},
        {"gpus": 0},
        {"gpus": 6, "tensor_parallel": 4},
        {"recompute": "some"},
        {"buffers_bytes": -1},
        {"gpu_memory_bytes": 0},
        {**SHAPE, "heads": 0},
    ],
)
def test_impossible_setups_are_refused(kwargs: dict[str, Any]) -> None:
    params = kwargs.pop("params", 10**9)
    with pytest.raises(ValueError):
        estimate_memory(params, **kwargs)
