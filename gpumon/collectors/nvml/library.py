"""The NVML library for the whole process: loading and releasing it, what its errors are
called, and the two errors the collector raises (``NvmlUnavailable``, ``GpuLost``).
"""

from __future__ import annotations

import pynvml

from gpumon.errors import GpumonError

__all__ = ["GpuLost", "NvmlUnavailable", "error_name", "init", "shutdown", "text"]


class NvmlUnavailable(GpumonError):
    """NVML cannot be used on this node (no library, no driver, version mismatch)."""


class GpuLost(GpumonError):
    """The GPU answered GPU_IS_LOST: it has fallen off the bus."""


def error_name(exc: BaseException) -> str:
    """A short, label-safe name for an NVML (or other) error."""
    if isinstance(exc, pynvml.NVMLError):
        text = pynvml.nvmlErrorString(exc.value) if exc.value is not None else "unknown"
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        return "_".join(str(text).lower().replace("-", " ").split())[:48] or "unknown"
    return type(exc).__name__.lower()


def text(value: str | bytes) -> str:
    """A string NVML returned, decoded where it came as bytes."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def init() -> tuple[str, str]:
    """Initialise NVML; return (driver version, NVML version). Raises NvmlUnavailable."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML initialisation failed: {_describe(exc)}") from exc
    except pynvml.NVMLLibraryMismatchError as exc:  # not an NVMLError subclass
        raise NvmlUnavailable(f"NVML library/driver mismatch: {exc}") from exc
    except OSError as exc:
        raise NvmlUnavailable(f"cannot load libnvidia-ml.so.1: {exc}") from exc
    return text(pynvml.nvmlSystemGetDriverVersion()), text(pynvml.nvmlSystemGetNVMLVersion())


def shutdown() -> None:
    """Release NVML; errors on the way out are not interesting."""
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass


def _describe(exc: pynvml.NVMLError) -> str:
    if exc.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return "libnvidia-ml.so.1 not found (no NVIDIA driver installed?)"
    if exc.value == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "the NVIDIA kernel driver is not loaded"
    if exc.value == pynvml.NVML_ERROR_NO_PERMISSION:
        return "no permission to access the GPU device files"
    return str(exc)
