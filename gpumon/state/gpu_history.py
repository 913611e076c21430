"""Each GPU's recent samples as the per-step windows read them, kept compact.

A window (``analysis.window.summarize_gpu_window``) reads a sample's time, whether the GPU was
up, the means' fields, memory used and total, and the clock-event reasons. The history keeps
those only, as one array of doubles per sample, with the reasons shared between samples
alike; a window's samples are made again as ``GpuSample`` when a window asks for them. A
whole sample is ~2.4 KB (its dicts and number objects): 8 GPUs × 600 of them held ~10 MB
after ten minutes; packed, ~0.3 KB each.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import attrgetter

from gpumon.analysis.window import MEAN_FIELDS
from gpumon.collectors.samples import GpuSample

_INT_FIELDS = ("memory_used_bytes", "memory_total_bytes")
_FIELDS = (*MEAN_FIELDS, *_INT_FIELDS)
_HEAD = 3  # t, up, the mask of fields that were None
_FIRST_INT = _HEAD + len(MEAN_FIELDS)

Packed = tuple["array[float]", dict[str, bool] | None]
"""(t, up, None-mask, the fields' values as doubles; the clock-event reasons)."""


def pack(sample: GpuSample, previous: Packed | None) -> Packed:
    """``sample`` as the history keeps it; its reasons shared with ``previous`` when equal."""
    values = _read_fields(sample)
    mask = 0
    if None in values:
        for bit, value in enumerate(values):
            if value is None:
                mask |= 1 << bit
        values = tuple(0.0 if value is None else value for value in values)
    packed = array("d", (sample.t, 1.0 if sample.up else 0.0, mask))
    packed.extend(values)
    reasons = sample.clock_event_reasons
    if previous is not None and reasons == previous[1]:
        reasons = previous[1]
    return packed, reasons


_read_fields = attrgetter(*_FIELDS)
"""A sample's packed fields as one tuple, in ``_FIELDS``' order (one call for all)."""


def window(history: Sequence[Packed], index: int, t0: float, t1: float) -> list[GpuSample]:
    """The samples of GPU ``index`` with ``t0 <= t <= t1``, as ``GpuSample`` again (the fields
    a window does not read left None)."""
    return [_unpack(index, packed) for packed in history if t0 <= packed[0][0] <= t1]


def _unpack(index: int, packed: Packed) -> GpuSample:
    values, reasons = packed
    mask = int(values[2])
    fields: dict[str, float | int | None] = {}
    for bit, name in enumerate(_FIELDS):
        if mask >> bit & 1:
            fields[name] = None
        else:
            value = values[_HEAD + bit]
            fields[name] = int(value) if _HEAD + bit >= _FIRST_INT else value
    return GpuSample(index=index, t=values[0], up=values[1] == 1.0,
                     clock_event_reasons=reasons, **fields)  # type: ignore[arg-type]
