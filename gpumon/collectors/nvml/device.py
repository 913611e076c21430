"""One GPU through NVML: static facts, the fast set, counters, GPM and the slow set.

Every call goes through :meth:`NvmlDevice._query`, which turns NOT_SUPPORTED into a
remembered absence (the metric is never asked again and never exported as 0), falls back
to an older symbol when the driver lacks a newer one (``versions.py``), and raises :class:`GpuLost` when the
GPU has fallen off the bus. A symbol the driver lacks is learnt once for the process (the
library is the same for every GPU) and said once, by its name. Units are converted to base
units here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from gpumon.collectors.gpu_fields import FIELDS_BY_NAME, GPU_FIELDS
from gpumon.collectors.nvml import versions
from gpumon.collectors.nvml.batch import FieldBatch, GpmMetrics
from gpumon.collectors.nvml.library import GpuLost, error_name, text
from gpumon.collectors.samples import GpuSample, GpuStatic

log = logging.getLogger(__name__)

ALL_LINKS_SCOPE = 0xFFFFFFFF
GPM_MIN_INTERVAL_S = 0.1
SLOW_INTERVAL_S = 10.0

# Field ids (nvml.h): cumulative counters.
_FI_NVLINK_TX_KIB = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
_FI_NVLINK_RX_KIB = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
_FI_PCIE_TX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
_FI_PCIE_RX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
_FI_NVLINK_LINK_COUNT = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT

# The table's plain field values, read together: (row, field id).
_FIELD_VALUES = tuple((f, getattr(pynvml, f.nvml)) for f in GPU_FIELDS if f.field_value)
_CONVERT = {f.name: f.convert for f in GPU_FIELDS}

# GPM metric id -> its conversion from the GpuSample field's row (percent to ratio).
_GPM_METRICS = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: FIELDS_BY_NAME["sm_active_ratio"].convert,
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: FIELDS_BY_NAME["sm_occupancy_ratio"].convert,
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: FIELDS_BY_NAME["tensor_active_ratio"].convert,
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: FIELDS_BY_NAME["dram_active_ratio"].convert,
}

# Clock event ("throttle") reason bits, named as exported in the `reason` label.
CLOCK_EVENT_REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}

_ARCHITECTURES = {
    2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing",
    7: "ampere", 8: "ada", 9: "hopper", 10: "blackwell",
}


class _Unsupported(Exception):
    """Internal: the call is not supported for this GPU."""


@dataclass
class _Counters:
    """Previous counter reading (bytes by field id), for bytes/s rates."""

    t: float
    values: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _SlowReadings:
    """The readings taken every SLOW_INTERVAL_S, repeated in the samples between."""

    process_memory_bytes: dict[int, int] | None = None
    ecc_errors_total: dict[str, int] | None = None


class NvmlDevice:
    """One GPU: cached static facts and a fast poll that returns a :class:`GpuSample`."""

    def __init__(self, index: int, on_error: Callable[[str, str], None]) -> None:
        self.index = index
        self._on_error = on_error
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._unsupported: set[str] = set()
        self._gpm_samples: tuple[Any, Any] | None = None
        self._gpm_metrics: GpmMetrics | None = None
        self._gpm_next = 0  # which of the two samples the next reading goes into
        self._gpm_t = 0.0
        self._gpm_values: dict[int, float] = {}
        self._counters: _Counters | None = None
        self._counter_batch: FieldBatch | None = None
        self._field_batch: FieldBatch | None = None
        self._slow_t = float("-inf")
        self._slow = _SlowReadings()
        self.lost = False
        self.static = self._read_static()

    # -- the one query helper -------------------------------------------------
    def _query(self, group: str, fn: Callable[..., Any] | versions.Versioned, *args: Any) -> Any:
        """Call NVML; NOT_SUPPORTED marks ``group`` absent for good, GPU_IS_LOST raises.

        A :class:`Versioned` call uses its newer symbol unless the library is known to lack
        it; the first time it is found missing, the older call answers from then on.
        """
        if group in self._unsupported:
            raise _Unsupported(group)
        if isinstance(fn, versions.Versioned):
            if not versions.is_missing(fn.symbol):
                try:
                    return self._call(group, fn.newer, args, versioned=True)
                except versions.MissingSymbol:
                    versions.learn_missing(fn.symbol)
            fn = fn.older
        return self._call(group, fn, args, versioned=False)

    def _call(self, group: str, fn: Callable[..., Any], args: tuple[Any, ...],
              versioned: bool) -> Any:
        try:
            return fn(self._handle, *args)
        except pynvml.NVMLLibraryMismatchError:
            # pynvml's unversioned wrappers say "mismatch" when the versioned symbol is
            # missing (an older driver): the same situation as FUNCTION_NOT_FOUND.
            if versioned:
                raise versions.MissingSymbol from None
            self._unsupported.add(group)
            raise _Unsupported(group) from None
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND and versioned:
                raise versions.MissingSymbol from None
            if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED,
                             pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                self._unsupported.add(group)
                raise _Unsupported(group) from exc
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(f"GPU {self.index} is lost") from exc
            self._on_error("nvml", error_name(exc))
            raise _Unsupported(group) from exc

    def _optional(self, group: str, fn: Callable[..., Any] | versions.Versioned, *args: Any) -> Any:
        try:
            return self._query(group, fn, *args)
        except _Unsupported:
            return None

    # -- static facts ----------------------------------------------------------
    def _read_static(self) -> GpuStatic:
        name = text(pynvml.nvmlDeviceGetName(self._handle))
        uuid = text(pynvml.nvmlDeviceGetUUID(self._handle))
        pci = self._optional("pci", pynvml.nvmlDeviceGetPciInfo)
        memory = self._memory_info()
        links = self._field_values("nvlink_count", [_FI_NVLINK_LINK_COUNT])
        mig = self._optional("mig", pynvml.nvmlDeviceGetMigMode)
        max_clock = self._optional("max_clock", pynvml.nvmlDeviceGetMaxClockInfo,
                                   pynvml.NVML_CLOCK_SM)
        arch = self._optional("architecture", pynvml.nvmlDeviceGetArchitecture)
        gpm = self._optional("gpm", lambda h: pynvml.nvmlGpmQueryDeviceSupport(h))
        if gpm is not None and gpm.isSupportedDevice:
            first = self._optional("gpm", lambda h: pynvml.nvmlGpmSampleAlloc())
            second = self._optional("gpm", lambda h: pynvml.nvmlGpmSampleAlloc())
            if first is not None and second is not None:
                self._gpm_samples = (first, second)
                self._gpm_metrics = GpmMetrics(list(_GPM_METRICS), first, second)
        if self._gpm_samples is None:
            self._unsupported.add("gpm")
        link_count = links.get(_FI_NVLINK_LINK_COUNT)
        if not link_count:
            # No NVLink on this GPU: its throughput counters are absent, not zero.
            self._unsupported.add("nvlink")
        return GpuStatic(
            index=self.index,
            uuid=uuid,
            name=name,
            pci_bus_id=text(pci.busId) if pci is not None else "",
            memory_total_bytes=memory.total if memory is not None else None,
            nvlink_link_count=link_count,
            mig_enabled=bool(mig[0]) if mig is not None else None,
            gpm_supported=self._gpm_samples is not None,
            max_sm_clock_hz=max_clock * 1e6 if max_clock is not None else None,
            architecture=_ARCHITECTURES.get(arch) if arch is not None else None,
        )

    def _memory_info(self) -> Any:
        return self._optional("memory", versions.MEMORY_INFO)

    def _field_values(self, group: str, field_ids: list[int | tuple[int, int]]) -> dict[int, int]:
        """Batch-read fields; entries that fail individually are left out."""
        values = self._optional(group, pynvml.nvmlDeviceGetFieldValues, field_ids)
        out: dict[int, int] = {}
        for entry in values or ():
            if entry.nvmlReturn == pynvml.NVML_SUCCESS:
                out[entry.fieldId] = _field_value(entry)
            elif entry.nvmlReturn == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(f"GPU {self.index} is lost")
        return out

    # -- the poll --------------------------------------------------------------
    def sample(self, now: float, monotonic: float) -> GpuSample:
        """Read the fast set (and, every SLOW_INTERVAL_S, processes and ECC)."""
        try:
            return self._sample(now, monotonic)
        except GpuLost:
            if not self.lost:
                log.error("GPU %d (%s) is lost: marking it down", self.index, self.static.uuid)
            self.lost = True
            return GpuSample(index=self.index, t=now, up=False, error="gpu_is_lost")

    def _sample(self, now: float, monotonic: float) -> GpuSample:
        memory = self._memory_info()
        util = self._optional("utilization", pynvml.nvmlDeviceGetUtilizationRates)
        power_mw = self._optional("power", pynvml.nvmlDeviceGetPowerUsage)
        temp = self._optional("temperature", versions.TEMPERATURE)
        clock = self._optional("clock", pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM)
        reasons = self._optional("clock_events", versions.CLOCK_EVENT_REASONS_CALL)
        field_values = self._plain_field_values()
        totals, rates = self._counter_values(monotonic)
        gpm = self._gpm(monotonic)
        if monotonic - self._slow_t >= SLOW_INTERVAL_S:
            self._slow_t = monotonic
            self._slow = self._slow_values()
        # Each reading by its keyword, so that a misspelt field fails the type check, not a
        # poll. The table's generic field values go by the table's names (each a GpuSample
        # attribute, as tests/collectors/test_gpu_fields.py holds); with every other field
        # named here, the type check also holds that they land only on float fields.
        return GpuSample(
            index=self.index,
            t=now,
            up=True,
            error=None,
            utilization_ratio=(None if util is None
                               else _CONVERT["utilization_ratio"](util.gpu)),
            memory_utilization_ratio=(None if util is None
                                      else _CONVERT["memory_utilization_ratio"](util.memory)),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            pcie_tx_bytes_total=totals.get(_FI_PCIE_TX_BYTES),
            pcie_rx_bytes_total=totals.get(_FI_PCIE_RX_BYTES),
            nvlink_tx_bytes_total=totals.get(_FI_NVLINK_TX_KIB),
            nvlink_rx_bytes_total=totals.get(_FI_NVLINK_RX_KIB),
            sm_active_ratio=gpm.get(pynvml.NVML_GPM_METRIC_SM_UTIL),
            sm_occupancy_ratio=gpm.get(pynvml.NVML_GPM_METRIC_SM_OCCUPANCY),
            tensor_active_ratio=gpm.get(pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL),
            dram_active_ratio=gpm.get(pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL),
            power_watts=None if power_mw is None else _CONVERT["power_watts"](power_mw),
            temperature_celsius=(None if temp is None
                                 else _CONVERT["temperature_celsius"](temp)),
            sm_clock_hz=None if clock is None else _CONVERT["sm_clock_hz"](clock),
            clock_event_reasons=None if reasons is None else {
                name: bool(reasons & bit) for name, bit in CLOCK_EVENT_REASONS.items()},
            ecc_errors_total=self._slow.ecc_errors_total,
            process_memory_bytes=self._slow.process_memory_bytes,
            nvlink_tx_bytes_per_second=rates.get(_FI_NVLINK_TX_KIB),
            nvlink_rx_bytes_per_second=rates.get(_FI_NVLINK_RX_KIB),
            pcie_tx_bytes_per_second=rates.get(_FI_PCIE_TX_BYTES),
            pcie_rx_bytes_per_second=rates.get(_FI_PCIE_RX_BYTES),
            **field_values,
        )

    def _counter_values(self, monotonic: float) -> tuple[dict[int, int], dict[int, float]]:
        """The byte counters read now and their rates since the previous reading (bytes/s),
        by field id; a counter the GPU does not give is left out of both."""
        ids: list[tuple[int, int]] = []
        if "nvlink" not in self._unsupported:
            ids += [(_FI_NVLINK_TX_KIB, ALL_LINKS_SCOPE), (_FI_NVLINK_RX_KIB, ALL_LINKS_SCOPE)]
        if "pcie_counters" not in self._unsupported:
            ids += [(_FI_PCIE_TX_BYTES, 0), (_FI_PCIE_RX_BYTES, 0)]
        if not ids:
            return {}, {}
        batch = self._counter_batch
        if batch is None or batch.fields != ids:  # built once; again only when a group goes
            batch = self._counter_batch = FieldBatch(self._handle, ids)
        answers = self._optional("counters", _read_batch, batch)
        if answers is None:
            return {}, {}
        totals: dict[int, int] = {}
        for (field_id, _scope), (ret, value) in zip(ids, answers, strict=True):
            if ret == pynvml.NVML_SUCCESS:
                totals[field_id] = int(_COUNTER_TO_BYTES[field_id](value))
            elif ret == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(f"GPU {self.index} is lost")
        if totals.keys().isdisjoint(_NVLINK_COUNTERS):
            self._unsupported.add("nvlink")
        if totals.keys().isdisjoint(_PCIE_COUNTERS):
            self._unsupported.add("pcie_counters")
        rates: dict[int, float] = {}
        previous, self._counters = self._counters, _Counters(monotonic, totals)
        if previous is not None and monotonic > previous.t:
            dt = monotonic - previous.t
            for field_id, value in totals.items():
                before = previous.values.get(field_id)
                if before is not None and value >= before:
                    rates[field_id] = (value - before) / dt
        return totals, rates

    def _plain_field_values(self) -> dict[str, float]:
        """The table's field values in one call, through a request built once (``FieldBatch``:
        the binding built it anew and read it through its structure classes at every poll);
        one a GPU does not support is not asked again."""
        wanted = [(f, field_id) for f, field_id in _FIELD_VALUES if f.name not in self._unsupported]
        if not wanted:
            return {}
        ids = [(field_id, 0) for _, field_id in wanted]
        batch = self._field_batch
        if batch is None or batch.fields != ids:  # built once; again only when a field goes
            batch = self._field_batch = FieldBatch(self._handle, ids)
        answers = self._optional("field_values", _read_batch, batch)
        out: dict[str, float] = {}
        for (row, _), (ret, value) in zip(wanted, answers or (), strict=False):
            if ret == pynvml.NVML_SUCCESS:
                out[row.name] = row.convert(value)
            elif ret == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(f"GPU {self.index} is lost")
            elif ret in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                self._unsupported.add(row.name)
        return out

    def _gpm(self, monotonic: float) -> dict[int, float]:
        """GPM metrics (ratios by metric id) between the previous sample and now, taken at
        most every 100 ms."""
        if not self._gpm_samples or "gpm" in self._unsupported:
            return {}
        if monotonic - self._gpm_t < GPM_MIN_INTERVAL_S:
            return self._gpm_values
        current = self._gpm_next
        if self._optional("gpm", pynvml.nvmlGpmSampleGet, self._gpm_samples[current]) is None:
            return {}
        had_previous, self._gpm_t = self._gpm_t > 0.0, monotonic
        # The sample just taken becomes the baseline of the next pair.
        self._gpm_next = 1 - current
        if not had_previous or self._gpm_metrics is None:
            return {}
        readings = self._optional("gpm", _read_gpm, self._gpm_metrics, current == 1)
        if readings is None:
            return {}
        values = {metric: min(max(convert(reading), 0.0), 1.0)
                  for (metric, convert), reading in zip(_GPM_METRICS.items(), readings,
                                                        strict=True)
                  if reading is not None}
        self._gpm_values = values
        return values

    def _slow_values(self) -> _SlowReadings:
        processes = self._optional("processes", versions.PROCESSES)
        ecc: dict[str, int] = {}
        for kind, error_type in (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                 ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            count = self._optional("ecc", pynvml.nvmlDeviceGetTotalEccErrors,
                                   error_type, pynvml.NVML_VOLATILE_ECC)
            if count is not None:
                ecc[kind] = int(count)
        return _SlowReadings(
            process_memory_bytes=None if processes is None else {
                p.pid: int(p.usedGpuMemory) for p in processes if p.usedGpuMemory is not None},
            ecc_errors_total=ecc or None,
        )

    def supports(self, group: str) -> bool:
        """Whether a metric group has answered (so far) on this GPU."""
        return group not in self._unsupported

    def close(self) -> None:
        """Free NVML resources held for this GPU."""
        for sample in self._gpm_samples or ():
            try:
                pynvml.nvmlGpmSampleFree(sample)
            except pynvml.NVMLError:
                pass
        self._gpm_samples = None


# Counter field id -> its conversion to bytes, from the GpuSample field's row.
_COUNTER_TO_BYTES = {
    _FI_NVLINK_TX_KIB: FIELDS_BY_NAME["nvlink_tx_bytes_total"].convert,
    _FI_NVLINK_RX_KIB: FIELDS_BY_NAME["nvlink_rx_bytes_total"].convert,
    _FI_PCIE_TX_BYTES: FIELDS_BY_NAME["pcie_tx_bytes_total"].convert,
    _FI_PCIE_RX_BYTES: FIELDS_BY_NAME["pcie_rx_bytes_total"].convert,
}
_NVLINK_COUNTERS = frozenset((_FI_NVLINK_TX_KIB, _FI_NVLINK_RX_KIB))
_PCIE_COUNTERS = frozenset((_FI_PCIE_TX_BYTES, _FI_PCIE_RX_BYTES))


def _read_batch(_handle: Any, batch: FieldBatch) -> list[tuple[int, int]]:
    return batch.read()


def _read_gpm(_handle: Any, metrics: GpmMetrics, first_is_earlier: bool) -> list[float | None]:
    return metrics.read(first_is_earlier)


def _field_value(entry: Any) -> int:
    kind = entry.valueType
    if kind == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return int(entry.value.dVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return int(entry.value.uiVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(entry.value.ulVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return int(entry.value.sllVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
        return int(entry.value.siVal)
    return int(entry.value.ullVal)
