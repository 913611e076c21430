"""A GPU's field values in one ``nvmlDeviceGetFieldValues`` request: the table's generic fields
(by row name) and the byte counters (bytes by field id, with their rates since the previous
reading).

The request is built once (``FieldBatch``: the binding built it anew and read it through its
structure classes at every poll), and again only when a field or a group of counters is found
unsupported, without it. What a failed request means (the group unsupported, the GPU lost, an
error counted) is the device's query helper's to say: ``read`` takes it as ``optional``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from gpumon.collectors.gpu_fields import FIELDS_BY_NAME, GPU_FIELDS, GpuField
from gpumon.collectors.nvml.batch import FieldBatch
from gpumon.collectors.nvml.library import GpuLost

ALL_LINKS_SCOPE = 0xFFFFFFFF

# Field ids (nvml.h): cumulative counters, and the NVLink count read at start.
FI_NVLINK_TX_KIB = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
FI_NVLINK_RX_KIB = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
FI_PCIE_TX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
FI_PCIE_RX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
FI_NVLINK_LINK_COUNT = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT

# The table's plain field values, read together: (row, field id).
_FIELD_VALUES = tuple((f, getattr(pynvml, f.nvml)) for f in GPU_FIELDS if f.field_value)
TABLE_ABSENT: dict[str, float | None] = {f.name: None for f, _ in _FIELD_VALUES}
"""Each of the table's fields as absent: what a sample has of those not read."""

# Counter field id -> its conversion to bytes, from the GpuSample field's row.
_COUNTER_TO_BYTES = {
    FI_NVLINK_TX_KIB: FIELDS_BY_NAME["nvlink_tx_bytes_total"].convert,
    FI_NVLINK_RX_KIB: FIELDS_BY_NAME["nvlink_rx_bytes_total"].convert,
    FI_PCIE_TX_BYTES: FIELDS_BY_NAME["pcie_tx_bytes_total"].convert,
    FI_PCIE_RX_BYTES: FIELDS_BY_NAME["pcie_rx_bytes_total"].convert,
}
_NVLINK_COUNTERS = frozenset((FI_NVLINK_TX_KIB, FI_NVLINK_RX_KIB))
_PCIE_COUNTERS = frozenset((FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES))


@dataclass
class _Counters:
    """Previous counter reading (bytes by field id), for bytes/s rates."""

    t: float
    values: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Request:
    """One GPU's field-value request: the table's rows, then the byte counters."""

    batch: FieldBatch
    rows: tuple[GpuField, ...]
    """The table's rows asked, in request order."""
    counters: tuple[int, ...]
    """The counters' field ids asked, after the rows."""


class FieldValues:
    """One GPU's field values and byte counters, and the counters' previous reading."""

    def __init__(self, handle: Any, index: int) -> None:
        self._handle = handle
        self._index = index
        self.request: Request | None = None
        """The request as asked now; None: to be built (again)."""
        self._counters: _Counters | None = None

    def read(self, optional: Callable[..., Any],
             unsupported: set[str]) -> tuple[dict[str, float], dict[int, int]]:
        """The table's field values (by row name) and the byte counters (bytes by field id).
        ``optional(group, fn, *args)`` makes the call (None where it failed); a field or group
        found unsupported goes into ``unsupported``."""
        request = self.request
        if request is None:
            request = self.request = self._prepare(unsupported)
            if request is None:
                return {}, {}
        answers = optional("field_values", _read_batch, request.batch)
        if answers is None:
            return {}, {}
        values: dict[str, float] = {}
        rows = request.rows
        for i, (ret, value) in enumerate(answers[:len(rows)]):
            if ret == pynvml.NVML_SUCCESS:
                values[rows[i].name] = rows[i].convert(value)
            elif ret == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(f"GPU {self._index} is lost")
            elif ret in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                unsupported.add(rows[i].name)
                self.request = None
        totals: dict[int, int] = {}
        for field_id, (ret, value) in zip(request.counters, answers[len(rows):], strict=True):
            if ret == pynvml.NVML_SUCCESS:
                totals[field_id] = int(_COUNTER_TO_BYTES[field_id](value))
            elif ret == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(f"GPU {self._index} is lost")
        for group, counters in (("nvlink", _NVLINK_COUNTERS), ("pcie_counters", _PCIE_COUNTERS)):
            if group not in unsupported and totals.keys().isdisjoint(counters):
                unsupported.add(group)
                self.request = None
        return values, totals

    def _prepare(self, unsupported: set[str]) -> Request | None:
        """The request of the fields and counters still asked (None: none is)."""
        rows = tuple(row for row, _ in _FIELD_VALUES if row.name not in unsupported)
        ids = [(field_id, 0) for row, field_id in _FIELD_VALUES if row in rows]
        if "nvlink" not in unsupported:
            ids += [(FI_NVLINK_TX_KIB, ALL_LINKS_SCOPE), (FI_NVLINK_RX_KIB, ALL_LINKS_SCOPE)]
        if "pcie_counters" not in unsupported:
            ids += [(FI_PCIE_TX_BYTES, 0), (FI_PCIE_RX_BYTES, 0)]
        if not ids:
            return None
        counters = tuple(field_id for field_id, _ in ids[len(rows):])
        return Request(FieldBatch(self._handle, ids), rows, counters)

    def rates(self, monotonic: float, totals: dict[int, int]) -> dict[int, float]:
        """The counters' rates since the previous reading (bytes/s), by field id."""
        rates: dict[int, float] = {}
        previous, self._counters = self._counters, _Counters(monotonic, totals)
        if previous is not None and monotonic > previous.t:
            dt = monotonic - previous.t
            for field_id, value in totals.items():
                before = previous.values.get(field_id)
                if before is not None and value >= before:
                    rates[field_id] = (value - before) / dt
        return rates


def _read_batch(_handle: Any, batch: FieldBatch) -> list[tuple[int, int]]:
    return batch.read()
