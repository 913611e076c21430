"""Schedules for the simulated training job: which bottleneck it hits, for how long.

A schedule is a small TOML file with one ``[[phase]]`` table per phase, run in order (the
demo repeats it)::

    [[phase]]
    kind = "compute"          # compute | input | communication | memory_bandwidth | host
    seconds = 20              #   | leak | straggler

    [[phase]]
    kind = "straggler"
    seconds = 25
    rank = 3                  # optional: the slow rank (default: the last one)
    slowdown = 1.6            # optional: its compute time, times this

    [[phase]]
    kind = "leak"
    seconds = 40
    peak_ratio = 0.97         # optional: per-step peak memory reached at the end, of capacity

``default`` (every kind, about three minutes) and ``short`` (every kind, 8 s each, for tests)
ship with gpumon; ``load_schedule`` takes either name or a path.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any

from gpumon.errors import GpumonError


class PhaseKind(str, Enum):
    """What limits the simulated job during a phase."""

    COMPUTE = "compute"
    INPUT = "input"
    COMMUNICATION = "communication"
    MEMORY_BANDWIDTH = "memory_bandwidth"
    HOST = "host"
    LEAK = "leak"
    STRAGGLER = "straggler"


DEFAULT_SLOWDOWN = 1.6
DEFAULT_PEAK_RATIO = 0.97
MAX_PHASE_SECONDS = 86400.0

# Keys a phase of each kind may carry beyond ``kind`` and ``seconds``.
_EXTRA_KEYS = {
    PhaseKind.STRAGGLER: {"rank", "slowdown"},
    PhaseKind.LEAK: {"peak_ratio"},
}
BUILTIN_SCHEDULES = ("default", "short")


class ScheduleError(GpumonError, ValueError):
    """A schedule is invalid; the message names the file, the phase and the key."""


@dataclass(frozen=True)
class Phase:
    """One phase of a schedule."""

    kind: PhaseKind
    seconds: float
    rank: int | None = None
    """Straggler phases: the slow rank; ``None`` means the last rank."""
    slowdown: float = DEFAULT_SLOWDOWN
    """Straggler phases: the slow rank's compute time ÷ its peers'."""
    peak_ratio: float = DEFAULT_PEAK_RATIO
    """Leak phases: the per-step memory peak at the end of the phase, as a share of capacity."""


@dataclass(frozen=True)
class Schedule:
    """Phases in order; ``at`` finds the phase at a time since the start."""

    phases: tuple[Phase, ...]
    source: str = "<schedule>"

    @property
    def seconds(self) -> float:
        """Length of one pass through every phase."""
        return sum(p.seconds for p in self.phases)

    def at(self, elapsed_s: float, loop: bool = True) -> tuple[int, float] | None:
        """(position, seconds into that phase) at ``elapsed_s`` since the start.

        The position counts phases from the start across repetitions (``position %
        len(phases)`` is the phase); ``None`` once a single pass is over and ``loop`` is off.
        """
        total = self.seconds
        passes = 0
        if elapsed_s >= total:
            if not loop:
                return None
            passes = int(elapsed_s // total)
            elapsed_s -= passes * total
        offset = 0.0
        for index, phase in enumerate(self.phases):
            if elapsed_s < offset + phase.seconds:
                return passes * len(self.phases) + index, elapsed_s - offset
            offset += phase.seconds
        # Rounding left elapsed_s a hair short of the total: the end of the last phase.
        return passes * len(self.phases) + len(self.phases) - 1, self.phases[-1].seconds

    def phase(self, position: int) -> Phase:
        """The phase at a position returned by ``at``."""
        return self.phases[position % len(self.phases)]


def load_schedule(name_or_path: str | Path) -> Schedule:
    """A built-in schedule by name (``default``, ``short``) or one read from a TOML file."""
    if str(name_or_path) in BUILTIN_SCHEDULES:
        name = str(name_or_path)
        text = resources.files("gpumon.sim").joinpath("schedules", f"{name}.toml").read_text()
        return parse_schedule(text, f"built-in schedule {name!r}")
    path = Path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScheduleError(f"cannot read schedule {path}: {exc.strerror or exc}") from exc
    return parse_schedule(text, str(path))


def parse_schedule(text: str, source: str = "<schedule>") -> Schedule:
    """Parse and validate a schedule's TOML text; ``source`` names it in error messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScheduleError(f"{source} is not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - {"phase"})
    if unknown:
        raise ScheduleError(f"{source}: unknown key(s) {', '.join(unknown)}; "
                            "a schedule is a list of [[phase]] tables")
    tables = data.get("phase")
    if not isinstance(tables, list) or not tables:
        raise ScheduleError(f"{source}: no phases; add [[phase]] tables with kind and seconds")
    return Schedule(tuple(_phase(t, f"{source}: phase {n}") for n, t in enumerate(tables, 1)),
                    source)


def _phase(table: Any, where: str) -> Phase:
    if not isinstance(table, dict):
        raise ScheduleError(f"{where}: expected a table")
    kinds = ", ".join(k.value for k in PhaseKind)
    raw_kind = table.get("kind")
    try:
        kind = PhaseKind(raw_kind)
    except ValueError:
        raise ScheduleError(f"{where}: kind={raw_kind!r}; choose one of {kinds}") from None
    allowed = {"kind", "seconds"} | _EXTRA_KEYS.get(kind, set())
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ScheduleError(f"{where}: unknown key(s) {', '.join(unknown)} for kind "
                            f"{kind.value!r}; allowed: {', '.join(sorted(allowed))}")
    if "seconds" not in table:
        raise ScheduleError(f"{where}: seconds is required")
    seconds = _number(table["seconds"], f"{where}: seconds", 1.0, MAX_PHASE_SECONDS)
    rank = table.get("rank")
    if rank is not None and (type(rank) is not int or rank < 0):
        raise ScheduleError(f"{where}: rank={rank!r}: expected a rank number (0, 1, ...)")
    slowdown = _number(table.get("slowdown", DEFAULT_SLOWDOWN), f"{where}: slowdown", 1.0, 10.0)
    peak_ratio = _number(table.get("peak_ratio", DEFAULT_PEAK_RATIO), f"{where}: peak_ratio",
                         0.7, 0.99)
    return Phase(kind, seconds, rank, slowdown, peak_ratio)


def _number(value: Any, where: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScheduleError(f"{where}={value!r}: expected a number")
    if not low <= value <= high:  # also rejects NaN
        raise ScheduleError(f"{where}={value!r}: must be between {low:g} and {high:g}")
    return float(value)


__all__ = ["BUILTIN_SCHEDULES", "Phase", "PhaseKind", "Schedule", "ScheduleError",
           "load_schedule", "parse_schedule"]
