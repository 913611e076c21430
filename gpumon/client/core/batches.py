"""How many samples a batch holds, told from the batch itself: what the integrations, the
DeepSpeed watcher and ``gpumon run``'s step finder count when the loop does not say."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def batch_size(batch: Any, depth: int = 0) -> int | None:
    """The leading dimension of a batch: a tensor, or the first tensor in a tuple/list/dict."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    if depth < 3:
        if isinstance(batch, Mapping):
            return batch_size(next(iter(batch.values()), None), depth + 1)
        if isinstance(batch, (list, tuple)) and batch:
            return batch_size(batch[0], depth + 1)
    return None
