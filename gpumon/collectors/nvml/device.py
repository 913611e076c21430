"""One GPU through NVML: static facts, the fast set, counters, GPM and the slow set.

Every call that fails goes through :meth:`NvmlDevice._query`, which turns NOT_SUPPORTED into
a remembered absence (the metric is never asked again and never exported as 0), falls back to
an older symbol when the driver lacks a newer one (``versions.py``), and raises
:class:`GpuLost` when the GPU has fallen off the bus. A symbol the driver lacks is learnt once
for the process (the library is the same for every GPU) and said once, by its name. The fast
set's reads are prepared once (``scalars.py``), the field values and counters read in one
request (``field_values.py``). Units are converted to base units here.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import pynvml

from gpumon.collectors.gpu_fields import FIELDS_BY_NAME, GPU_FIELDS
from gpumon.collectors.nvml import versions
from gpumon.collectors.nvml.batch import GpmMetrics
from gpumon.collectors.nvml.field_values import (
    FI_NVLINK_LINK_COUNT,
    FI_NVLINK_RX_KIB,
    FI_NVLINK_TX_KIB,
    FI_PCIE_RX_BYTES,
    FI_PCIE_TX_BYTES,
    TABLE_ABSENT,
    FieldValues,
)
from gpumon.collectors.nvml.library import GpuLost, error_name, text
from gpumon.collectors.nvml.scalars import Prepared, Scalar, Scalars
from gpumon.collectors.samples import GpuSample, GpuStatic
from gpumon.wire.frozen import maker

log = logging.getLogger(__name__)

GPM_MIN_INTERVAL_S = 0.1
SLOW_INTERVAL_S = 10.0

_new_sample = cast(type[GpuSample], maker(GpuSample))
"""``GpuSample(...)`` of every field, without the frozen ``__init__``'s per-field
``object.__setattr__`` (a poll makes one a GPU a cycle: 4.8 against 1.5 µs)."""
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
        self._scalars = Scalars(self._handle)
        self._plan: list[tuple[str, Any, Prepared | None]] | None = None
        """The fast set's reads as called now (``_plan_scalars``); None: to be made again."""
        self._reasons: tuple[int, dict[str, bool]] | None = None
        """The last clock-event mask and its names: a new dict only when the mask changes."""
        self._unsupported: set[str] = set()
        self._gpm_samples: tuple[Any, Any] | None = None
        self._gpm_metrics: GpmMetrics | None = None
        self._gpm_next = 0  # which of the two samples the next reading goes into
        self._gpm_t = 0.0
        self._gpm_values: dict[int, float] = {}
        self._fields = FieldValues(self._handle, index)
        self._slow_t = float("-inf")
        self._slow = _SlowReadings()
        self.lost = False
        self.static = self._read_static()

    # -- the one query helper -------------------------------------------------
    def _query(self, group: str, fn: Callable[..., Any] | versions.Versioned, *args: Any) -> Any:
        """Call NVML; NOT_SUPPORTED marks ``group`` absent for good, GPU_IS_LOST raises.

        A :class:`Versioned` call uses its newer symbol unless the library is known to lack
        it; the first time it is found missing, the older call answers from then on. The
        answered call costs one frame: failures are sorted out in ``_failed``. (Its caller,
        ``_optional``, has left out a group already unsupported.)
        """
        if isinstance(fn, versions.Versioned):
            if not versions.is_missing(fn.symbol):
                try:
                    return fn.newer(self._handle, *args)
                except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
                    if not _symbol_missing(exc):
                        self._failed(group, exc)
                versions.learn_missing(fn.symbol)
            fn = fn.older
        try:
            return fn(self._handle, *args)
        except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
            self._failed(group, exc)

    def _failed(self, group: str, exc: Exception) -> NoReturn:
        """Raise what a failed call means: the group unsupported for good (NOT_SUPPORTED, or
        its symbol missing), the GPU lost, or this poll's reading absent (any other error,
        counted)."""
        # pynvml's unversioned wrappers say "mismatch" when the versioned symbol is missing
        # (an older driver): the same situation as FUNCTION_NOT_FOUND.
        if isinstance(exc, pynvml.NVMLLibraryMismatchError) or exc.value in (  # type: ignore[attr-defined]
                pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            self._unsupported.add(group)
            raise _Unsupported(group) from exc
        if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:  # type: ignore[attr-defined]
            raise GpuLost(f"GPU {self.index} is lost") from exc
        self._on_error("nvml", error_name(exc))
        raise _Unsupported(group) from exc

    def _optional(self, group: str, fn: Callable[..., Any] | versions.Versioned, *args: Any) -> Any:
        if group in self._unsupported:
            return None
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
        links = self._field_values("nvlink_count", [FI_NVLINK_LINK_COUNT])
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
        link_count = links.get(FI_NVLINK_LINK_COUNT)
        if not link_count:
            # No NVLink on this GPU: its throughput counters are absent, not zero.
            self._unsupported.add("nvlink")
        return GpuStatic(
            index=self.index,
            uuid=uuid,
            name=name,
            pci_bus_id=text(pci.busId) if pci is not None else "",
            memory_total_bytes=memory[1] if memory is not None else None,
            nvlink_link_count=link_count,
            mig_enabled=bool(mig[0]) if mig is not None else None,
            gpm_supported=self._gpm_samples is not None,
            max_sm_clock_hz=max_clock * 1e6 if max_clock is not None else None,
            architecture=_ARCHITECTURES.get(arch) if arch is not None else None,
        )

    def _memory_info(self) -> tuple[int, int] | None:
        """(used, total) bytes."""
        return self._optional("memory", self._scalars.memory)  # type: ignore[no-any-return]

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
        readings = self._scalar_readings()
        memory = readings.get("memory")
        util = readings.get("utilization")
        power_mw = readings.get("power")
        temp = readings.get("temperature")
        clock = readings.get("clock")
        reasons = readings.get("clock_events")
        field_values, totals = self._fields.read(self._optional, self._unsupported)
        rates = self._fields.rates(monotonic, totals)
        gpm = self._gpm(monotonic)
        if monotonic - self._slow_t >= SLOW_INTERVAL_S:
            self._slow_t = monotonic
            self._slow = self._slow_values()
        # Each reading by its keyword, so that a misspelt field fails the type check, not a
        # poll. The table's generic field values go by the table's names (each a GpuSample
        # attribute, as tests/collectors/test_gpu_fields.py holds); with every other field
        # named here, the type check also holds that they land only on float fields.
        # (``_new_sample`` takes every field: the table's that were not read come as None.)
        return _new_sample(
            index=self.index,
            t=now,
            up=True,
            error=None,
            utilization_ratio=(None if util is None
                               else _CONVERT["utilization_ratio"](util[0])),
            memory_utilization_ratio=(None if util is None
                                      else _CONVERT["memory_utilization_ratio"](util[1])),
            memory_used_bytes=None if memory is None else memory[0],
            memory_total_bytes=None if memory is None else memory[1],
            pcie_tx_bytes_total=totals.get(FI_PCIE_TX_BYTES),
            pcie_rx_bytes_total=totals.get(FI_PCIE_RX_BYTES),
            nvlink_tx_bytes_total=totals.get(FI_NVLINK_TX_KIB),
            nvlink_rx_bytes_total=totals.get(FI_NVLINK_RX_KIB),
            sm_active_ratio=gpm.get(pynvml.NVML_GPM_METRIC_SM_UTIL),
            sm_occupancy_ratio=gpm.get(pynvml.NVML_GPM_METRIC_SM_OCCUPANCY),
            tensor_active_ratio=gpm.get(pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL),
            dram_active_ratio=gpm.get(pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL),
            power_watts=None if power_mw is None else _CONVERT["power_watts"](power_mw),
            temperature_celsius=(None if temp is None
                                 else _CONVERT["temperature_celsius"](temp)),
            sm_clock_hz=None if clock is None else _CONVERT["sm_clock_hz"](clock),
            clock_event_reasons=None if reasons is None else self._reason_names(reasons),
            ecc_errors_total=self._slow.ecc_errors_total,
            process_memory_bytes=self._slow.process_memory_bytes,
            nvlink_tx_bytes_per_second=rates.get(FI_NVLINK_TX_KIB),
            nvlink_rx_bytes_per_second=rates.get(FI_NVLINK_RX_KIB),
            pcie_tx_bytes_per_second=rates.get(FI_PCIE_TX_BYTES),
            pcie_rx_bytes_per_second=rates.get(FI_PCIE_RX_BYTES),
            **(TABLE_ABSENT | field_values),
        )

    def _scalar_readings(self) -> dict[str, Any]:
        """The fast set's scalars by group. Each read that answers is one call into the
        library; one that fails, or whose entry point is not there, goes through
        ``_optional`` (and its meaning is learnt there), and the plan is made again."""
        plan = self._plan
        if plan is None:
            plan = self._plan = self._plan_scalars()
        out: dict[str, Any] = {}
        for group, reader, call in plan:
            if call is not None:
                fn, args, answer = call
                if fn(*args) == 0:
                    out[group] = answer()
                    continue
            self._plan = None
            value = self._optional(group, reader)
            if value is not None:
                out[group] = value
        return out

    def _plan_scalars(self) -> list[tuple[str, Any, Prepared | None]]:
        """(group, its reader, the prepared call) for each group still read: a versioned
        read's newer call unless the library is known to lack it."""
        plan = []
        for group, reader in self._scalars.by_group().items():
            if group in self._unsupported:
                continue
            chosen: Any = reader
            if isinstance(reader, versions.Versioned):
                chosen = reader.older if versions.is_missing(reader.symbol) else reader.newer
            plan.append((group, reader, chosen.prepared() if isinstance(chosen, Scalar) else None))
        return plan

    def _reason_names(self, mask: int) -> dict[str, bool]:
        """Each clock-event reason by name, active or not. The mask seldom changes, and its
        dict is shared by the samples that have it (no reader changes a sample)."""
        last = self._reasons
        if last is None or last[0] != mask:
            last = self._reasons = (mask, {name: bool(mask & bit)
                                           for name, bit in CLOCK_EVENT_REASONS.items()})
        return last[1]

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


def _symbol_missing(exc: Exception) -> bool:
    """Whether a versioned call failed because the library lacks its newer entry point."""
    return isinstance(exc, pynvml.NVMLLibraryMismatchError) or \
        exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND  # type: ignore[attr-defined]


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
