"""What a DeepSpeed rank holds beyond its model's ``param.data`` and ``param.grad``, for the
memory breakdown (``memory``), under each ZeRO stage.

- **parameters**: at stage 3, each parameter's partition (``param.ds_tensor``, views of one
  flat buffer; ``param.data`` is empty between its gathers); at stages 0-2 the parameters
  themselves (flattened into one buffer at 1-2), which the breakdown already counts.
- **gradients**: the reduced, partitioned gradients ZeRO keeps outside ``param.grad``
  (``averaged_gradients`` at stages 1-2, ``grad_partitions_flat_buffer`` at stage 3), beside
  the ``param.grad`` the breakdown reads when backward ends (full at stages 0-1, freed as they
  are reduced at 2-3).
- **optimizer states**: the states of the torch optimizer DeepSpeed wraps
  (``engine.optimizer.optimizer``), which the breakdown finds itself, and the fp32 master
  partitions it updates (``single_partition_of_fp32_groups`` at stages 1-2,
  ``fp32_partitioned_groups_flat`` at 3), each storage once.
- **communication buffers**: the reduction buckets (``ipg_buckets``; at stage 3 allocated
  whole, ``reduce_bucket_size`` elements) are temporary buffers, counted in ``other``, not as
  this rank's gradients.

Attributes are read by name with defaults: a DeepSpeed that renamed one leaves that part to
the generic breakdown, never an error.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

GRADIENT_ATTRIBUTES = ("averaged_gradients", "grad_partitions_flat_buffer", "grads_in_partition")
"""Where ZeRO's optimizers keep this rank's reduced gradients."""
MASTER_ATTRIBUTES = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
"""Where they keep this rank's fp32 master partitions (stage 3 lists them in the torch
optimizer's ``param_groups`` only while it steps)."""


class DeepSpeedHoldings:
    """A ``memory.Holdings`` for one engine: read at each sampled step (the engine may swap
    its buffers between steps). Holds the engine weakly, as the breakdown holds models."""

    def __init__(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)

    def parameters(self) -> Iterator[torch.Tensor]:
        module = getattr(self._engine(), "module", None)
        if module is None:
            return
        for param in module.parameters():
            partition = getattr(param, "ds_tensor", None)
            if isinstance(partition, torch.Tensor):
                yield partition

    def gradients(self) -> Iterator[torch.Tensor]:
        optimizer = getattr(self._engine(), "optimizer", None)
        for name in GRADIENT_ATTRIBUTES:
            yield from _tensors(getattr(optimizer, name, None))

    def optimizer_states(self) -> Iterator[torch.Tensor]:
        optimizer = getattr(self._engine(), "optimizer", None)
        for name in MASTER_ATTRIBUTES:
            yield from _tensors(getattr(optimizer, name, None))

    def buffers(self) -> Iterator[torch.Tensor]:
        optimizer = getattr(self._engine(), "optimizer", None)
        buckets = getattr(optimizer, "ipg_buckets", None)
        if isinstance(buckets, dict):
            for bucket in buckets.values():
                yield from _tensors(getattr(bucket, "buffer", None))


def _tensors(value: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """The tensors in ``value``: a tensor, or lists and dicts of them (three levels deep)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)
