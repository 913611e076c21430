"""Peak figures of common training GPUs, looked up by NVML device name, and MFU.

Every FLOP/s figure is the *dense* (no 2:4 sparsity) tensor-core peak for 16-bit inputs with
FP32 accumulation — what a PyTorch bf16/fp16 matmul can reach — taken from NVIDIA's datasheets
and architecture whitepapers (cited per entry). Datasheets usually print the sparse figure with
an asterisk; the dense one is half of it. Memory capacities are nominal (HBM sizes are binary,
so "80GB" is taken as 80 GiB); NVML's own total is authoritative at run time.

``nvlink_bytes_per_second`` is the aggregate NVLink bandwidth of one GPU in *one direction*
(the datasheets' "900 GB/s" for H100 SXM is both directions together). It is ``None`` for
cards whose NVLink depends on an optional bridge, or that have none.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass

_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Datasheet peaks of one GPU model."""

    key: str
    peak_flops: float
    """Dense tensor-core FLOP/s at ``peak_dtype`` with FP32 accumulation."""
    peak_dtype: str
    hbm_bytes_per_second: float
    memory_bytes: int
    nvlink_bytes_per_second: float | None
    source: str

    @property
    def ridge_point_flops_per_byte(self) -> float:
        """Roofline ridge point: arithmetic intensity above which kernels can be compute-bound."""
        return self.peak_flops / self.hbm_bytes_per_second


# Order matters: the first pattern that matches the NVML name wins, so more specific models
# (H100 PCIe, H200 NVL) precede their general family. Word boundaries keep "GH200" from
# matching "H200": its memory system differs.
_DEVICES: tuple[tuple[str, DeviceSpec], ...] = (
    (
        r"\bB200\b",
        DeviceSpec(
            "B200", 2.25e15, "bf16", 8.0e12, 180 * _GIB, 900e9,
            # DGX B200 datasheet: 72 PFLOPS FP8 training over 8 GPUs (dense BF16 is half of
            # FP8: 2.25 PFLOPS/GPU), 1,440 GB HBM3e and 64 TB/s over 8 GPUs, NVLink 5 1.8 TB/s.
            "NVIDIA DGX B200 datasheet",
        ),
    ),
    (
        r"\bH200 NVL\b",
        DeviceSpec(
            "H200 NVL", 835e12, "bf16", 4.8e12, 141 * _GIB, None,
            "NVIDIA H200 datasheet, H200 NVL column: BF16 1,671 TFLOPS with sparsity",
        ),
    ),
    (
        r"\bH200\b",
        DeviceSpec(
            "H200 SXM", 989e12, "bf16", 4.8e12, 141 * _GIB, 450e9,
            "NVIDIA H200 datasheet, H200 SXM column: BF16 1,979 TFLOPS with sparsity, "
            "4.8 TB/s, NVLink 900 GB/s",
        ),
    ),
    (
        r"\bH100 PCIe\b",
        DeviceSpec(
            "H100 PCIe", 756e12, "bf16", 2.0e12, 80 * _GIB, None,
            "NVIDIA H100 datasheet, H100 PCIe column: BF16 1,513 TFLOPS with sparsity, 2 TB/s",
        ),
    ),
    (
        r"\bH100 NVL\b",
        DeviceSpec(
            "H100 NVL", 835e12, "bf16", 3.9e12, 94 * _GIB, None,
            "NVIDIA H100 datasheet, H100 NVL column: BF16 1,671 TFLOPS with sparsity, 3.9 TB/s",
        ),
    ),
    (
        # NVML names the SXM5 part "NVIDIA H100 80GB HBM3"; PCIe and NVL matched above.
        r"\bH100\b",
        DeviceSpec(
            "H100 SXM", 989e12, "bf16", 3.35e12, 80 * _GIB, 450e9,
            "NVIDIA H100 datasheet, H100 SXM column: BF16 1,979 TFLOPS with sparsity, "
            "3.35 TB/s, NVLink 900 GB/s",
        ),
    ),
    (
        r"\bA100\b.*\b40GB\b",
        DeviceSpec(
            "A100 40GB", 312e12, "bf16", 1.555e12, 40 * _GIB, 300e9,
            "NVIDIA A100 datasheet: BF16 312 TFLOPS dense, 40GB HBM2 1,555 GB/s, NVLink 600 GB/s",
        ),
    ),
    (
        r"\bA100\b",
        DeviceSpec(
            "A100 80GB", 312e12, "bf16", 2.0e12, 80 * _GIB, 300e9,
            # The 80GB PCIe card has 1,935 GB/s; the 3% difference does not move a verdict.
            "NVIDIA A100 datasheet: BF16 312 TFLOPS dense, 80GB HBM2e 2,039 GB/s (SXM), "
            "NVLink 600 GB/s",
        ),
    ),
    (
        r"\bL40S\b",
        DeviceSpec(
            "L40S", 362e12, "bf16", 864e9, 48 * _GIB, None,
            "NVIDIA L40S datasheet: BF16 733 TFLOPS with sparsity (362 dense), 864 GB/s",
        ),
    ),
    (
        r"\bL4\b",
        DeviceSpec(
            "L4", 121e12, "bf16", 300e9, 24 * _GIB, None,
            "NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity, 300 GB/s",
        ),
    ),
    (
        r"\bRTX 4090\b",
        DeviceSpec(
            "RTX 4090", 165.2e12, "bf16", 1008e9, 24 * _GIB, None,
            # GeForce parts run FP32-accumulate tensor math at half the FP16-accumulate rate;
            # PyTorch accumulates in FP32, so 165.2 (not 330.3) is the reachable peak.
            "NVIDIA Ada Lovelace architecture whitepaper, appendix: peak BF16 tensor TFLOPS "
            "with FP32 accumulate 165.2 dense, 1,008 GB/s",
        ),
    ),
    (
        r"\bA10\b",
        DeviceSpec(
            "A10", 125e12, "bf16", 600e9, 24 * _GIB, None,
            "NVIDIA A10 datasheet: BF16 125 TFLOPS dense, 600 GB/s",
        ),
    ),
    (
        r"\bV100\b.*\bPCIE\b",
        DeviceSpec(
            "V100 PCIe", 112e12, "fp16", 900e9, 16 * _GIB, None,
            "NVIDIA V100 datasheet, PCIe column: tensor performance 112 TFLOPS (fp16; no bf16)",
        ),
    ),
    (
        r"\bV100\b",
        DeviceSpec(
            "V100 SXM2", 125e12, "fp16", 900e9, 16 * _GIB, 150e9,
            "NVIDIA V100 datasheet, SXM2 column: tensor performance 125 TFLOPS (fp16; no bf16), "
            "NVLink 300 GB/s",
        ),
    ),
    (
        r"\bT4\b",
        DeviceSpec(
            "T4", 65e12, "fp16", 320e9, 16 * _GIB, None,
            "NVIDIA T4 datasheet: mixed precision (FP16/FP32) 65 TFLOPS, 320 GB/s",
        ),
    ),
)

_COMPILED = tuple((re.compile(pattern, re.IGNORECASE), spec) for pattern, spec in _DEVICES)

_MEMORY_SIZE = re.compile(r"(\d+)\s*GB", re.IGNORECASE)


def known_devices() -> tuple[DeviceSpec, ...]:
    """Every device in the table, most specific first."""
    return tuple(spec for _, spec in _DEVICES)


@functools.lru_cache(maxsize=256)
def lookup_device(name: str) -> DeviceSpec | None:
    """The spec whose pattern matches an NVML device name (``"NVIDIA H100 80GB HBM3"``), if any.

    When the name carries a memory size that differs from the nominal one (``A100-SXM4-40GB``,
    ``V100-SXM2-32GB``), the returned spec carries the size from the name. Kept per name (a
    spec is frozen, the table fixed): the engine asks three times a window.
    """
    for pattern, spec in _COMPILED:
        if pattern.search(name):
            size = _MEMORY_SIZE.search(name)
            if size is not None and int(size.group(1)) * _GIB != spec.memory_bytes:
                return dataclasses.replace(spec, memory_bytes=int(size.group(1)) * _GIB)
            return spec
    return None


def resolve_peak_flops(name: str | None, override: float | None = None) -> float | None:
    """Peak FLOP/s for MFU: an explicit ``override`` wins, else the table's, else ``None``."""
    if override is not None:
        return override
    spec = None if name is None else lookup_device(name)
    return None if spec is None else spec.peak_flops


def resolve_peak_dram(name: str | None, override: float | None = None) -> float | None:
    """Peak HBM bytes/s: an explicit ``override`` wins, else the table's, else ``None``."""
    if override is not None:
        return override
    spec = None if name is None else lookup_device(name)
    return None if spec is None else spec.hbm_bytes_per_second


def resolve_peak_nvlink(name: str | None, override: float | None = None) -> float | None:
    """Aggregate one-direction NVLink bytes/s: ``override`` wins, else the table's, else ``None``."""
    if override is not None:
        return override
    spec = None if name is None else lookup_device(name)
    return None if spec is None else spec.nvlink_bytes_per_second


def mfu(flops_per_step: float, duration_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s of a step over the device's peak FLOP/s.

    Not clipped to 1: a value above 1 means the flops count or the peak is wrong, and hiding
    that would hide the bug.
    """
    for label, value in (("duration_s", duration_s), ("peak_flops", peak_flops)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{label} must be a positive finite number, got {value!r}")
    if not math.isfinite(flops_per_step) or flops_per_step < 0:
        raise ValueError(f"flops_per_step must be a non-negative finite number, got {flops_per_step!r}")
    return flops_per_step / (duration_s * peak_flops)
