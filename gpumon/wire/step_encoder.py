"""The training process's step records, formatted by hand: most of the sender's cost per step.

``StepEncoder`` writes the same compact JSON as ``encode.encode_record`` for one rank's steps,
through templates: the record's constant head (identity, pid, GPU) is JSON-encoded once, each
sequence of phase names becomes a ``%``-template, the allocator statistics a format string.
Safe without escaping because every string in it is a validated label (run and phase names)
or was encoded by ``json`` (the head), and every number is checked here against the limits
table (``limits.FIELD_LIMITS``) before it is written: a value the agent would refuse is left
out and counted in ``invalid_fields``, never sent to cost the whole record.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping

from gpumon.wire.encode import encode_measured_field, encode_record
from gpumon.wire.limits import FIELD_LIMITS, MAX_PHASES, PROTOCOL_VERSION
from gpumon.wire.records import MEM_WIRE_NAMES, ProtocolError

MAX_PHASE_TEMPLATES = 64
"""Distinct sequences of phase names kept formatted; code whose names change every step
starts over at this many."""

_MAX_STEP = int(FIELD_LIMITS["step"].high)
_MAX_COUNT = int(FIELD_LIMITS["samples"].high)
_MAX_FLOPS = FIELD_LIMITS["flops"].high
_MEM_KEYS = frozenset(MEM_WIRE_NAMES)
_MEM_FORMAT = ',"mem":{{' + ",".join(f'"{name}":{{:d}}' for name in MEM_WIRE_NAMES) + "}}"

Formatter = Callable[[str, object, int, float, float, dict[str, float], object, object, object], "str | None"]
"""``formatter(prefix, step, default_step, t_start, duration, phases, samples, tokens, flops)``:
the record up to its counts, exactly as ``StepEncoder.encode`` writes it, or ``None`` where it
would leave out, clamp or fold anything (``gpumon.client.core._hook.format_step``, in C)."""
LIMITS = (_MAX_STEP, _MAX_COUNT, _MAX_FLOPS, MAX_PHASES)
"""What a ``Formatter`` writes as it is: the step number, counts and FLOPs up to these, and at
most this many phases."""


class StepEncoder:
    """Formats one rank's step records; ``invalid_fields`` counts what it had to leave out."""

    def __init__(
        self,
        run: str,
        rank: int,
        world: int | None = None,
        local_rank: int | None = None,
        pid: int | None = None,
        gpu: str | int | None = None,
        formatter: Formatter | None = None,
    ) -> None:
        """The identity every step record of this rank carries (already validated);
        ``formatter`` writes the common records faster (see ``Formatter``)."""
        head: dict[str, object] = {"v": PROTOCOL_VERSION, "kind": "step", "run": run, "rank": rank}
        optional = {"world": world, "local_rank": local_rank, "pid": pid, "gpu": gpu}
        head.update((k, v) for k, v in optional.items() if v is not None)
        self._head_fields = head
        self._formatter = formatter
        self._prefix, self._head = _step_head(head)
        self._phase_templates: dict[tuple[str, ...], str] = {}
        self.invalid_fields = 0

    def set_gpu(self, gpu: str | int) -> None:
        """Report ``gpu`` on every later record."""
        self._head_fields["gpu"] = gpu
        self._prefix, self._head = _step_head(self._head_fields)

    def encode(
        self,
        step: object,
        default_step: int,
        t_start: float,
        duration: float,
        phases: dict[str, float],
        samples: object = None,
        tokens: object = None,
        flops: object = None,
        mem: object = None,
        measured: Mapping[str, object] | None = None,
        device_phases: Iterable[str] = (),
    ) -> str:
        """One step record as JSON text. ``step`` is the caller's step number (``None``, or
        invalid: ``default_step``); ``t_start`` Unix seconds; ``mem`` the five allocator
        readings as a tuple (from CUDA) or a mapping of some of them (given by the caller);
        ``measured``: fields the monitor's extensions added (``comm``, ``memb``);
        ``device_phases``: the names in ``phases`` whose seconds are GPU time (``dev``)."""
        if self._formatter is not None and mem is None and not device_phases:
            text = self._formatter(self._prefix, step, default_step, t_start, duration, phases,
                                   samples, tokens, flops)
            if text is not None:
                return text + self._measured_fields(measured, duration) + "}" if measured else text + "}"
        if step is None:
            step = default_step
        elif not (type(step) is int and 0 <= step <= _MAX_STEP):
            self.invalid_fields += 1
            step = default_step
        text = self._head % (step, t_start, duration)
        if phases:
            text += self._phases_field(phases, duration)
            if device_phases:
                text += self._device_field(device_phases, phases)
        if samples is not None:
            text += self._count_field("samples", samples)
        if tokens is not None:
            text += self._count_field("tokens", tokens)
        if flops is not None:
            text += self._flops_field(flops)
        if type(mem) is tuple:
            try:
                text += _MEM_FORMAT.format(*mem)
            except (TypeError, ValueError, IndexError):
                self.invalid_fields += 1
        elif mem is not None:
            text += self._memory_field(mem)
        if measured:
            text += self._measured_fields(measured, duration)
        return text + "}"

    def _phases_field(self, phases: dict[str, float], duration: float) -> str:
        """The ``phases`` field, through one cached template per sequence of phase names."""
        names = tuple(phases)
        template = self._phase_templates.get(names) or self._phase_template(names)
        if template is None:  # more phases than a record takes: the last fold into "other"
            return ',"phases":{' + ",".join(f'"{k}":{v:.9g}' for k, v in _fit_phases(phases, duration)) + "}"
        seconds = tuple(phases.values())
        total = sum(seconds)  # NaN if any is NaN, which fails total == total
        if not (total == total and min(seconds) >= 0.0 and max(seconds) <= duration):
            # GPU time of a phase can exceed the host window of its step when the CPU ran ahead.
            seconds = tuple([_clamp(value, duration) for value in seconds])
        return template % seconds

    def _device_field(self, names: Iterable[str], phases: dict[str, float]) -> str:
        """The ``dev`` field: each name once, and only names the ``phases`` field carries."""
        listed = [name for name in dict.fromkeys(names) if name in phases]
        if len(phases) > MAX_PHASES or not listed:  # folded phases: which are GPU time is lost
            self.invalid_fields += 1
            return ""
        return ',"dev":["' + '","'.join(listed) + '"]'

    def _phase_template(self, names: tuple[str, ...]) -> str | None:
        """The ``phases`` field with a ``%.9g`` slot per phase, for up to MAX_PHASES names."""
        if len(names) > MAX_PHASES:
            return None
        if len(self._phase_templates) >= MAX_PHASE_TEMPLATES:
            self._phase_templates.clear()  # phase names that change every step: rare, bounded
        template = ',"phases":{' + ",".join(f'"{name}":%.9g' for name in names) + "}"
        self._phase_templates[names] = template
        return template

    def _memory_field(self, mem: object) -> str:
        """The ``mem`` field from statistics the caller gave ``step(memory=)``."""
        if not isinstance(mem, Mapping):
            self.invalid_fields += 1
            return ""
        parts = []
        for key, value in mem.items():
            count = _as_count(value) if key in _MEM_KEYS else None
            if count is None:
                self.invalid_fields += 1
            else:
                parts.append(f'"{key}":{count}')
        return ',"mem":{' + ",".join(parts) + "}" if parts else ""

    def _count_field(self, key: str, value: object) -> str:
        count = value if type(value) is int and 0 <= value <= _MAX_COUNT else _as_count(value)
        if count is None:
            self.invalid_fields += 1
            return ""
        return f',"{key}":{count}'

    def _flops_field(self, value: object) -> str:
        number = value if type(value) is float and 0.0 <= value <= _MAX_FLOPS else _as_flops(value)
        if number is None:
            self.invalid_fields += 1
            return ""
        return f',"flops":{number!r}'

    def _measured_fields(self, measured: Mapping[str, object], duration: float) -> str:
        text = ""
        for name, value in measured.items():
            try:
                text += encode_measured_field(name, value, duration)
            except (ProtocolError, TypeError, ValueError):
                self.invalid_fields += 1
        return text


def _step_head(header: Mapping[str, object]) -> tuple[str, str]:
    """A step record's constant fields, open for more (no closing brace), and its start as a
    template: those fields, then slots for the step number, start (Unix seconds) and duration."""
    prefix = encode_record(header).decode()[:-1]
    return prefix, prefix.replace("%", "%%") + ',"step":%d,"t_start":%.6f,"duration":%.9g'


def _fit_phases(phases: Mapping[str, float], duration: float) -> Iterable[tuple[str, float]]:
    """Phases as the agent accepts them: finite, none longer than the step, at most MAX_PHASES."""
    # GPU time of a phase can exceed the host window of its step when the CPU ran ahead.
    fitted = [
        (name, seconds if 0.0 <= seconds <= duration else _clamp(seconds, duration))
        for name, seconds in phases.items()
    ]
    if len(fitted) > MAX_PHASES:
        kept = fitted[: MAX_PHASES - 1]
        rest = sum(seconds for _, seconds in fitted[MAX_PHASES - 1 :])
        rest += sum(seconds for name, seconds in kept if name == "other")
        fitted = [(name, seconds) for name, seconds in kept if name != "other"]
        fitted.append(("other", min(rest, duration)))
    return fitted


def _clamp(seconds: float, duration: float) -> float:
    return min(seconds, duration) if seconds >= 0.0 else 0.0  # NaN fails both comparisons


def _as_count(value: object) -> int | None:
    """A Python or NumPy integer as an int in range, else None (bools and tensors too)."""
    if type(value) is not int:
        if isinstance(value, bool) or type(value).__module__.startswith("torch"):
            return None  # reading a tensor would synchronise with the GPU
        try:
            value = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            return None
    return value if 0 <= value <= _MAX_COUNT else None


def _as_flops(value: object) -> float | None:
    """A real number as a finite float in range, else None (bools and tensors too)."""
    if isinstance(value, bool) or type(value).__module__.startswith("torch"):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) and 0 <= number <= _MAX_FLOPS else None
