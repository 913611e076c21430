"""Calls through NVML entry points that older drivers lack, each with the older call that
reads the same, and what this process has learnt of which are missing: the library is the
same for every GPU, so a missing symbol is learnt once and said once, by its name."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

log = logging.getLogger("gpumon.nvml")


@dataclass(frozen=True)
class Versioned:
    """A call through a newer NVML entry point (``symbol``), and the older call that reads
    the same on a driver without it."""

    symbol: str
    newer: Callable[..., Any]
    older: Callable[..., Any]


_missing_symbols: set[str] = set()
"""Entry points this process's NVML library lacks: learnt once, never asked again."""
_missing_lock = threading.Lock()


def missing_symbols() -> frozenset[str]:
    """The newer entry points found missing in the loaded NVML library so far."""
    with _missing_lock:
        return frozenset(_missing_symbols)


def is_missing(symbol: str) -> bool:
    """Whether ``symbol`` was found missing already (read without the lock: a set lookup)."""
    return symbol in _missing_symbols


def learn_missing(symbol: str) -> None:
    """Remember that the library lacks ``symbol``, and say so the first time."""
    with _missing_lock:
        if symbol in _missing_symbols:
            return
        _missing_symbols.add(symbol)
    log.info("%s is missing in this NVML driver: using the older call on every GPU", symbol)


# Calls through entry points older drivers lack, with the older call that reads the same.
PROCESSES = Versioned(
    "nvmlDeviceGetComputeRunningProcesses_v3",
    pynvml.nvmlDeviceGetComputeRunningProcesses_v3,
    pynvml.nvmlDeviceGetComputeRunningProcesses_v2)

