"""Batched NVML reads through requests built once: field values and GPM metrics.

``nvmlDeviceGetFieldValues`` reads many fields in one call and ``nvmlGpmMetricsGet`` many
metrics. Through the binding, each poll would build its request anew and read every
entry through the binding's structure classes, whose attribute hooks cost more than the
calls themselves. Here a request is built once per GPU (the library writes only each
entry's answer) in plain ctypes structures of the same layout as nvml.h's, and the answers
are read straight from them. The entry points come from the binding (its loaded library);
errors are raised as its ``NVMLError``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml


class _Value(ctypes.Union):
    _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint),
                ("ulVal", ctypes.c_ulong), ("ullVal", ctypes.c_ulonglong),
                ("sllVal", ctypes.c_longlong), ("siVal", ctypes.c_int),
                ("usVal", ctypes.c_ushort)]


class _FieldValue(ctypes.Structure):
    """nvmlFieldValue_t."""

    _fields_ = [("fieldId", ctypes.c_uint32), ("scopeId", ctypes.c_uint32),
                ("timestamp", ctypes.c_int64), ("latencyUsec", ctypes.c_int64),
                ("valueType", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", _Value)]


class _MetricInfo(ctypes.Structure):
    _fields_ = [("shortName", ctypes.c_char_p), ("longName", ctypes.c_char_p),
                ("unit", ctypes.c_char_p)]


class _GpmMetric(ctypes.Structure):
    """nvmlGpmMetric_t."""

    _fields_ = [("metricId", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", ctypes.c_double), ("metricInfo", _MetricInfo)]


class _GpmMetricsGet(ctypes.Structure):
    """nvmlGpmMetricsGet_t."""

    _fields_ = [("version", ctypes.c_uint), ("numMetrics", ctypes.c_uint),
                ("sample1", ctypes.c_void_p), ("sample2", ctypes.c_void_p),
                ("metrics", _GpmMetric * pynvml.NVML_GPM_METRIC_MAX)]


_SIGNED = {pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
           pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal"}
_BY_TYPE = {pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
            pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
            pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
            pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal", **_SIGNED}


def _check(ret: int) -> None:
    if ret != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(ret)


class FieldBatch:
    """One GPU's fields read in one ``nvmlDeviceGetFieldValues`` call."""

    def __init__(self, handle: Any, fields: list[tuple[int, int]]) -> None:
        self.fields = list(fields)
        """(field id, scope id) pairs, in request order."""
        self._handle = handle
        self._entries = (_FieldValue * len(fields))()
        for entry, (field_id, scope_id) in zip(self._entries, fields, strict=True):
            entry.fieldId = field_id
            entry.scopeId = scope_id
        self._fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")

    def read(self) -> list[tuple[int, int]]:
        """(NVML return code, value as an int) per field, in request order; the call's own
        failure raises ``NVMLError``."""
        entries = self._entries
        _check(self._fn(self._handle, ctypes.c_int32(len(entries)), entries))
        out = []
        for entry in entries:
            ret = entry.nvmlReturn
            if ret != pynvml.NVML_SUCCESS:
                out.append((ret, 0))
                continue
            value = entry.value
            out.append((ret, int(getattr(value, _BY_TYPE.get(entry.valueType, "ullVal")))))
        return out


class GpmMetrics:
    """GPM metrics between two samples of one GPU, through two requests built once (the
    samples swap roles at every reading)."""

    def __init__(self, metric_ids: list[int], first: Any, second: Any) -> None:
        self.metric_ids = list(metric_ids)
        self._requests = (self._request(first, second), self._request(second, first))
        self._fn = pynvml._nvmlGetFunctionPointer("nvmlGpmMetricsGet")

    def _request(self, earlier: Any, later: Any) -> _GpmMetricsGet:
        request = _GpmMetricsGet()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self.metric_ids)
        request.sample1 = ctypes.cast(earlier, ctypes.c_void_p).value
        request.sample2 = ctypes.cast(later, ctypes.c_void_p).value
        for slot, metric_id in zip(request.metrics, self.metric_ids, strict=False):
            slot.metricId = metric_id
        return request

    def read(self, first_is_earlier: bool) -> list[float | None]:
        """Each metric's value (None where it failed) between the two samples: from the first
        to the second, or the other way round."""
        request = self._requests[0 if first_is_earlier else 1]
        _check(self._fn(ctypes.byref(request)))
        metrics = request.metrics
        return [metrics[i].value if metrics[i].nvmlReturn == pynvml.NVML_SUCCESS else None
                for i in range(len(self.metric_ids))]
