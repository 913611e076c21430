"""The ``gpumon estimate`` engine: per-GPU training memory by item, and which sharding fits.

Pure numbers: the words (table, advice, notes) are the command's, in ``gpumon.commands.estimate``.

The bytes come from ``gpumon.analysis.memory``, the model the live breakdown's ZeRO projection
uses too. Model states follow the usual mixed-precision accounting and the ZeRO paper
(Rajbhandari et al. 2020):

* parameters and gradients: 2 B/param in fp16/bf16, 4 B in fp32;
* optimizer states, kept in fp32: Adam/AdamW m + v = 8 B/param (the common count), SGD with
  momentum 4 B, plain SGD none;
* the fp32 master copy of the parameters that mixed-precision training keeps (4 B/param) is
  its own item: the 8 B/param count omits it, the ZeRO paper counts it inside its
  K = 12 (master 4 + m 4 + v 4). ``master_weights=True`` gives the paper's count; under fp32
  there is no separate copy.

ZeRO shards over the data-parallel GPUs: stage 1 the optimizer states and master copy, stage 2
also the gradients, stage 3 also the parameters. Tensor parallelism splits every model state
(and, per Korthikanti et al., part of the activations) over ``tensor_parallel`` GPUs; the
data-parallel degree is ``gpus / tensor_parallel``.

Activations per transformer layer follow Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", for 16-bit activations with tensor parallelism t
(no sequence parallelism): ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` bytes; the ``5·a·s/(h·t)``
attention-score term vanishes under FlashAttention or selective recomputation; with full
recomputation only each layer's input is kept, ``2·s·b·h``, plus one layer's activations while
it is being recomputed. fp32 activations double it. Embedding and output-layer activations (the
logits can be large for big vocabularies) are not counted. ``batch`` is the per-GPU micro-batch.

Sizes: GB = 10⁹ bytes, GiB = 2³⁰ bytes, everywhere.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from typing import Literal

from gpumon.analysis.memory import (
    OPTIMIZER_STATE_BYTES,
    WEIGHT_BYTES,
    Precision,
    Recompute,
    activation_bytes,
    model_states,
    shard_model_states,
)

OptimizerName = Literal["adam", "adamw", "sgd", "sgd_momentum"]

GB = 10**9
GIB = 2**30

DEFAULT_BUFFERS_BYTES = 2 * GB
"""Temporary buffers when none is given: the low end of the "about 2–4 GB" usually quoted for a 7B
case (communication buckets, fused-kernel and cuBLAS workspaces, the CUDA context). These are
largely independent of model size, so a fixed figure is closer than a fraction of the model."""

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*$", re.I)
_BYTES_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_BYTES = re.compile(
    r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)\s*(?:([kmgtp])(i)?)?b?\s*$", re.I
)


def parse_count(text: str) -> int:
    """A count such as ``"7B"``, ``"175M"``, ``"1.3e9"`` or ``"7000000"`` (K, M, B/G, T = 10³ⁿ)."""
    match = _COUNT.match(text)
    if match is None:
        raise ValueError(f"not a count: {text!r} (examples: 7B, 175M, 1.3e9)")
    return _scaled(match.group(1), Decimal(_COUNT_SUFFIX[match.group(2).lower()]), text)


def parse_bytes(text: str) -> int:
    """A size such as ``"80GB"`` (80·10⁹), ``"80GiB"`` (80·2³⁰), ``"141G"`` (= GB) or ``"1024"``.

    Decimal prefixes (K, M, G, T, P, with or without ``B``) are powers of 1000; binary ones
    (Ki, Mi, Gi, Ti, Pi) powers of 1024, as in Kubernetes quantities.
    """
    match = _BYTES.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 80GB, 80GiB, 141G)")
    prefix = (match.group(2) or "").lower()
    base = 1024 if match.group(3) else 1000
    return _scaled(match.group(1), Decimal(base) ** _BYTES_PREFIX[prefix], text)


def _scaled(number: str, scale: Decimal, text: str) -> int:
    try:
        value = Decimal(number) * scale
    except InvalidOperation as exc:  # the pattern admits only valid decimals; belt and braces
        raise ValueError(f"not a number: {text!r}") from exc
    return int(value.to_integral_value())


@dataclass(frozen=True, slots=True)
class ZeroOption:
    """A ZeRO stage under which the setup fits, on ``gpus`` GPUs (data × tensor parallel)."""

    stage: int
    gpus: int
    per_gpu_bytes: int | None = None
    """The per-GPU total under that stage, when it is the current number of GPUs."""


@dataclass(frozen=True, slots=True)
class Plan:
    """The estimate against the GPU's memory: fits, or which sharding would make it fit.

    ``zero_here`` is the lowest higher stage that fits on the current GPUs; without one,
    ``zero_from`` says from how many GPUs each stage fits (empty: activations and buffers
    alone fill the GPU).
    """

    fits: bool
    memory_bytes: int
    zero_here: ZeroOption | None = None
    zero_from: tuple[ZeroOption, ...] = ()


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Per-GPU bytes of each item of a training setup, with the setup and its plan."""

    params: int
    precision: str
    optimizer: str
    master_weights: bool
    zero_stage: int
    gpus: int
    tensor_parallel: int
    params_bytes: int
    grads_bytes: int
    optimizer_states_bytes: int
    master_weights_bytes: int
    activations_bytes: int | None
    """``None`` when the model shape was not given: activations are then not counted."""
    buffers_bytes: int
    buffers_default: bool
    gpu_memory_bytes: int | None
    recompute: str = "none"
    flash_attention: bool = False
    plan: Plan | None = None
    """Whether it fits and what sharding would make it fit; ``None`` without GPU memory."""

    @property
    def model_states_bytes(self) -> int:
        """Parameters + gradients + optimizer states + master copy."""
        return (
            self.params_bytes
            + self.grads_bytes
            + self.optimizer_states_bytes
            + self.master_weights_bytes
        )

    @property
    def total_bytes(self) -> int:
        """Everything per GPU (activations count 0 when not estimated)."""
        return self.model_states_bytes + (self.activations_bytes or 0) + self.buffers_bytes

    def fits(self, gpu_memory_bytes: int | None = None) -> bool | None:
        """Whether the total fits the given (else the estimate's) GPU memory; ``None`` if unknown."""
        memory = gpu_memory_bytes if gpu_memory_bytes is not None else self.gpu_memory_bytes
        return None if memory is None else self.total_bytes <= memory


@dataclass(frozen=True, slots=True)
class _Setup:
    params: int
    precision: str
    optimizer: str
    master_weights: bool
    tensor_parallel: int

    def model_states(self, zero_stage: int, data_parallel: int) -> tuple[int, int, int, int]:
        """(params, grads, optimizer states, master copy) bytes per GPU."""
        full = model_states(self.params / self.tensor_parallel, precision=self.precision,
                            optimizer=self.optimizer, master_weights=self.master_weights)
        held = shard_model_states(full, zero_stage, data_parallel)
        return held.parameters, held.gradients, held.optimizer_states, held.master_weights


def estimate_memory(
    params: int,
    *,
    precision: Precision = "bf16",
    optimizer: OptimizerName = "adamw",
    master_weights: bool = True,
    zero_stage: int = 0,
    gpus: int = 1,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    seq: int | None = None,
    batch: int | None = None,
    flash_attention: bool = False,
    recompute: Recompute = "none",
    tensor_parallel: int = 1,
    buffers_bytes: int | None = None,
    gpu_memory_bytes: int | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of training a ``params``-parameter model, item by item, with its plan.

    Raises ``ValueError`` for impossible setups (unknown precision, stage outside 0–3, GPUs not
    divisible by ``tensor_parallel``, a partial model shape, non-positive sizes).
    """
    _check(params, precision, optimizer, zero_stage, gpus, tensor_parallel, recompute,
           buffers_bytes, gpu_memory_bytes)
    shape = {"layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "batch": batch}
    given = {k: v for k, v in shape.items() if v is not None}
    if given and len(given) != len(shape):
        absent = ", ".join(k for k in shape if k not in given)
        raise ValueError(f"activations need the whole model shape; missing: {absent}")
    for name, value in given.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")

    setup = _Setup(params, precision, optimizer, master_weights, tensor_parallel)
    data_parallel = gpus // tensor_parallel
    p, g, o, m = setup.model_states(zero_stage, data_parallel)
    activations = None
    if layers and hidden and heads and seq and batch:
        activations = activation_bytes(
            layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch,
            flash_attention=flash_attention, recompute=recompute, precision=precision,
            tensor_parallel=tensor_parallel,
        )
    buffers = DEFAULT_BUFFERS_BYTES if buffers_bytes is None else buffers_bytes

    draft = MemoryEstimate(
        params=params, precision=precision, optimizer=optimizer, master_weights=master_weights,
        zero_stage=zero_stage, gpus=gpus, tensor_parallel=tensor_parallel,
        params_bytes=p, grads_bytes=g, optimizer_states_bytes=o, master_weights_bytes=m,
        activations_bytes=activations, buffers_bytes=buffers,
        buffers_default=buffers_bytes is None, gpu_memory_bytes=gpu_memory_bytes,
        recompute=recompute, flash_attention=flash_attention,
    )
    return replace(draft, plan=_plan(draft, setup))


def _check(
    params: int, precision: str, optimizer: str, zero_stage: int, gpus: int,
    tensor_parallel: int, recompute: str, buffers_bytes: int | None,
    gpu_memory_bytes: int | None,
) -> None:
    if params <= 0:
        raise ValueError(f"params must be positive, got {params!r}")
    if precision not in WEIGHT_BYTES:
        raise ValueError(f"precision must be one of {sorted(WEIGHT_BYTES)}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}"
        )
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if gpus < 1 or tensor_parallel < 1:
        raise ValueError("gpus and tensor_parallel must be at least 1")
    if gpus % tensor_parallel:
        raise ValueError(f"gpus ({gpus}) must be a multiple of tensor_parallel ({tensor_parallel})")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if buffers_bytes is not None and buffers_bytes < 0:
        raise ValueError(f"buffers_bytes must not be negative, got {buffers_bytes!r}")
    if gpu_memory_bytes is not None and gpu_memory_bytes <= 0:
        raise ValueError(f"gpu_memory_bytes must be positive, got {gpu_memory_bytes!r}")


def _plan(est: MemoryEstimate, setup: _Setup) -> Plan | None:
    """The decision path of docs/architecture.md §1 as facts: does it fit; if not, which ZeRO
    stage fits on the GPUs there are, else from how many GPUs each stage fits."""
    memory = est.gpu_memory_bytes
    if memory is None:
        return None
    if est.total_bytes <= memory:
        return Plan(fits=True, memory_bytes=memory)
    others = (est.activations_bytes or 0) + est.buffers_bytes
    data_parallel = est.gpus // est.tensor_parallel
    if data_parallel > 1:
        for stage in range(est.zero_stage + 1, 4):
            per_gpu = sum(setup.model_states(stage, data_parallel)) + others
            if per_gpu <= memory:
                return Plan(fits=False, memory_bytes=memory,
                            zero_here=ZeroOption(stage, est.gpus, per_gpu))
    options = []
    for stage in range(max(1, est.zero_stage), 4):
        n = _min_data_parallel(setup, stage, memory - others)
        if n is not None:
            options.append(ZeroOption(stage, n * est.tensor_parallel))
    return Plan(fits=False, memory_bytes=memory, zero_from=tuple(options))


def _min_data_parallel(setup: _Setup, stage: int, available: int) -> int | None:
    """Fewest data-parallel GPUs over which ``stage``'s model states fit ``available`` bytes."""
    p, g, _, _ = setup.model_states(0, 1)
    replicated = (p if stage < 3 else 0) + (g if stage < 2 else 0)
    if replicated >= available:
        return None
    sharded = sum(setup.model_states(0, 1)) - replicated
    n = max(1, math.ceil(sharded / (available - replicated)))
    # Each item is rounded up per GPU; step up while those few bytes still overflow.
    while sum(setup.model_states(stage, n)) > available:
        n += 1
    return n
