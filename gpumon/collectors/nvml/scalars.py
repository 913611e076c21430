"""The fast set's scalar reads (memory, utilisation, power, temperature, SM clock, clock
events) through entry points resolved once and outputs built once.

Through the binding, each of these reads looked its entry point up under a lock, built its
output structure anew, checked the answer in a call of its own, and was read back through
the binding's structure classes, whose attribute hooks cost more than the call: about
two-thirds of a poll on a fast library. Here each GPU prepares its reads when it is opened
(plain ctypes structures of nvml.h's layout, as ``batch.py`` does for field values), and a
read is one call into the library and a plain tuple or number out.

Failures look exactly as the binding's: a return code other than success is raised as its
``NVMLError`` (the subclass for the code), and an entry point the library lacks as
``NVML_ERROR_FUNCTION_NOT_FOUND``, when first called, so ``NvmlDevice`` learns a missing
newer symbol, or an unsupported read, the same way for both.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pynvml

from gpumon.collectors.nvml.versions import Versioned


class _MemoryV1(ctypes.Structure):
    """nvmlMemory_t."""

    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class _MemoryV2(ctypes.Structure):
    """nvmlMemory_v2_t."""

    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong),
                ("reserved", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class _Utilization(ctypes.Structure):
    """nvmlUtilization_t."""

    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _TemperatureV1(ctypes.Structure):
    """nvmlTemperature_v1_t."""

    _fields_ = [("version", ctypes.c_uint), ("sensorType", ctypes.c_uint),
                ("temperature", ctypes.c_int)]


Prepared = tuple[Any, tuple[Any, ...], Callable[[], Any]]
"""(entry point, its arguments, what reads its answer): one read, called as is."""


class Scalar:
    """One prepared read: an entry point (resolved at its first call), its arguments built
    once, and how its answer is read out of them."""

    __slots__ = ("symbol", "_fn", "_args", "_answer")

    def __init__(self, symbol: str, args: tuple[Any, ...], answer: Callable[[], Any]) -> None:
        self.symbol = symbol
        self._fn: Any = None
        self._args = args
        self._answer = answer

    def __call__(self, _handle: Any) -> Any:
        """The answer; raises ``NVMLError`` as the binding would. (The handle is in the
        arguments already; it is taken to be called where a binding call is.)"""
        fn = self._fn
        if fn is None:  # resolved once; a missing symbol raises FUNCTION_NOT_FOUND
            fn = self._fn = pynvml._nvmlGetFunctionPointer(self.symbol)
        ret = fn(*self._args)
        if ret != 0:
            raise pynvml.NVMLError(ret)
        return self._answer()

    def prepared(self) -> Prepared | None:
        """The read to call as is, or None where the library lacks the entry point."""
        try:
            fn = self._fn or pynvml._nvmlGetFunctionPointer(self.symbol)
        except pynvml.NVMLError:
            return None
        return fn, self._args, self._answer


class Scalars:
    """A GPU's fast-set reads, prepared: each a :class:`Versioned` pair where the newer entry
    point may be missing, else a :class:`Scalar`.

    ``memory`` answers (used, total) in bytes, ``utilization`` (gpu, memory) in percent,
    ``power`` milliwatts, ``temperature`` degrees C, ``sm_clock`` MHz, ``clock_events`` the
    reasons' bit mask.
    """

    def __init__(self, handle: Any) -> None:
        memory2 = _MemoryV2(version=pynvml.nvmlMemory_v2)
        memory1 = _MemoryV1()
        self.memory = Versioned(
            "nvmlDeviceGetMemoryInfo_v2",
            Scalar("nvmlDeviceGetMemoryInfo_v2", (handle, ctypes.byref(memory2)),
                   lambda: (memory2.used, memory2.total)),
            Scalar("nvmlDeviceGetMemoryInfo", (handle, ctypes.byref(memory1)),
                   lambda: (memory1.used, memory1.total)))
        utilization = _Utilization()
        self.utilization = Scalar("nvmlDeviceGetUtilizationRates",
                                  (handle, ctypes.byref(utilization)),
                                  lambda: (utilization.gpu, utilization.memory))
        power = ctypes.c_uint()
        self.power = Scalar("nvmlDeviceGetPowerUsage", (handle, ctypes.byref(power)),
                            lambda: power.value)
        temperature_v = _TemperatureV1(version=pynvml.nvmlTemperature_v1,
                                       sensorType=pynvml.NVML_TEMPERATURE_GPU)
        temperature = ctypes.c_uint()
        self.temperature = Versioned(
            "nvmlDeviceGetTemperatureV",
            Scalar("nvmlDeviceGetTemperatureV", (handle, ctypes.byref(temperature_v)),
                   lambda: temperature_v.temperature),
            Scalar("nvmlDeviceGetTemperature",
                   (handle, ctypes.c_uint(pynvml.NVML_TEMPERATURE_GPU),
                    ctypes.byref(temperature)),
                   lambda: temperature.value))
        clock = ctypes.c_uint()
        self.sm_clock = Scalar("nvmlDeviceGetClockInfo",
                               (handle, ctypes.c_uint(pynvml.NVML_CLOCK_SM), ctypes.byref(clock)),
                               lambda: clock.value)
        events, throttle = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        self.clock_events = Versioned(
            "nvmlDeviceGetCurrentClocksEventReasons",
            Scalar("nvmlDeviceGetCurrentClocksEventReasons", (handle, ctypes.byref(events)),
                   lambda: events.value),
            Scalar("nvmlDeviceGetCurrentClocksThrottleReasons",
                   (handle, ctypes.byref(throttle)), lambda: throttle.value))

    def by_group(self) -> dict[str, Scalar | Versioned]:
        """Each read by the group its absence is remembered as."""
        return {"memory": self.memory, "utilization": self.utilization, "power": self.power,
                "temperature": self.temperature, "clock": self.sm_clock,
                "clock_events": self.clock_events}
