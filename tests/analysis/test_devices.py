"""Device table lookup, overrides and MFU."""

from __future__ import annotations

import pytest

from gpumon.analysis.devices import (
    known_devices,
    lookup_device,
    mfu,
    resolve_peak_dram,
    resolve_peak_flops,
    resolve_peak_nvlink,
)

GIB = 2**30


@pytest.mark.parametrize(
    ("nvml_name", "key", "peak_flops", "hbm", "memory"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12, 3.35e12, 80 * GIB),
        ("NVIDIA H100 SXM5 80GB", "H100 SXM", 989e12, 3.35e12, 80 * GIB),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756e12, 2.0e12, 80 * GIB),
        ("NVIDIA H100 NVL", "H100 NVL", 835e12, 3.9e12, 94 * GIB),
        ("NVIDIA H200", "H200 SXM", 989e12, 4.8e12, 141 * GIB),
        ("NVIDIA H200 NVL", "H200 NVL", 835e12, 4.8e12, 141 * GIB),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB", 312e12, 2.0e12, 80 * GIB),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312e12, 1.555e12, 40 * GIB),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB", 312e12, 1.555e12, 40 * GIB),
        ("NVIDIA A100 80GB PCIe", "A100 80GB", 312e12, 2.0e12, 80 * GIB),
        ("NVIDIA L40S", "L40S", 362e12, 864e9, 48 * GIB),
        ("NVIDIA L4", "L4", 121e12, 300e9, 24 * GIB),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2e12, 1008e9, 24 * GIB),
        ("NVIDIA A10", "A10", 125e12, 600e9, 24 * GIB),
        ("Tesla V100-SXM2-16GB", "V100 SXM2", 125e12, 900e9, 16 * GIB),
        ("Tesla V100-SXM2-32GB", "V100 SXM2", 125e12, 900e9, 32 * GIB),
        ("Tesla V100-PCIE-16GB", "V100 PCIe", 112e12, 900e9, 16 * GIB),
        ("Tesla T4", "T4", 65e12, 320e9, 16 * GIB),
        ("NVIDIA B200", "B200", 2.25e15, 8.0e12, 180 * GIB),
    ],
)
def test_lookup_by_nvml_name(
    nvml_name: str, key: str, peak_flops: float, hbm: float, memory: int
) -> None:
    spec = lookup_device(nvml_name)
    assert spec is not None
    assert (spec.key, spec.peak_flops, spec.hbm_bytes_per_second, spec.memory_bytes) == (
        key, peak_flops, hbm, memory,
    )


@pytest.mark.parametrize(
    "nvml_name",
    [
        "NVIDIA GH200 480GB",  # contains "H200" but is a different memory system
        "NVIDIA GB200",
        "NVIDIA A10G",  # the AWS part clocks differently from the A10
        "NVIDIA A40",
        "Quadro RTX 8000",
        "",
    ],
)
def test_unknown_devices_are_not_guessed(nvml_name: str) -> None:
    assert lookup_device(nvml_name) is None


def test_every_entry_has_a_source_and_sane_ridge_point() -> None:
    for spec in known_devices():
        assert spec.source
        # Tensor-core GPUs of the last decade have ridge points of ~60–600 FLOP/byte.
        assert 50 < spec.ridge_point_flops_per_byte < 600, spec.key


@pytest.mark.parametrize(
    ("resolve", "name", "override", "expected"),
    [
        (resolve_peak_flops, "NVIDIA H100 80GB HBM3", None, 989e12),
        (resolve_peak_flops, "NVIDIA H100 80GB HBM3", 500e12, 500e12),
        (resolve_peak_flops, "Some Future GPU", None, None),
        (resolve_peak_flops, "Some Future GPU", 1e15, 1e15),
        (resolve_peak_flops, None, None, None),
        (resolve_peak_dram, "NVIDIA H200", None, 4.8e12),
        (resolve_peak_dram, "NVIDIA H200", 1e12, 1e12),
        (resolve_peak_nvlink, "NVIDIA H100 80GB HBM3", None, 450e9),
        (resolve_peak_nvlink, "NVIDIA GeForce RTX 4090", None, None),
    ],
)
def test_explicit_peak_wins(resolve, name, override, expected) -> None:  # type: ignore[no-untyped-def]
    assert resolve(name, override) == expected


@pytest.mark.parametrize(
    ("flops", "duration_s", "peak", "expected"),
    [
        (989e12 * 0.5, 1.0, 989e12, 0.5),
        (312e12, 2.0, 312e12, 0.5),
        (0.0, 1.0, 312e12, 0.0),
        (2 * 312e12, 1.0, 312e12, 2.0),  # over 1 means a wrong flops count: not hidden
    ],
)
def test_mfu(flops: float, duration_s: float, peak: float, expected: float) -> None:
    assert mfu(flops, duration_s, peak) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("flops", "duration_s", "peak"),
    [(1e12, 0.0, 1e12), (1e12, 1.0, 0.0), (-1.0, 1.0, 1e12), (1e12, float("nan"), 1e12)],
)
def test_mfu_rejects_impossible_inputs(flops: float, duration_s: float, peak: float) -> None:
    with pytest.raises(ValueError):
        mfu(flops, duration_s, peak)
