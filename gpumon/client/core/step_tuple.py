"""The tuple a core appends to the monitor's buffer for each recorded step, and its fields.

Both cores (``hook/step_core.c`` and ``step_core.py``) build it as a plain tuple, the cheapest object the
training thread can make, with ``StepFields``' fields in ``StepFields``' order; the sender
reads it by the indices below, derived from that one definition, and
``tests/client/test_core.py`` holds both cores to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from gpumon.client.core.cuda_clock import Mark, MemoryTuple

StepTuple = tuple[Any, ...]
"""What a core appends: ``StepFields``' fields, in order, as a plain tuple."""


class StepFields(NamedTuple):
    """The fields of a ``StepTuple``, by name (``StepFields._make(item)`` reads one)."""

    seq: int
    """Counts every completed step, recorded or not: a gap is steps the full buffer dropped."""
    step: int | None
    """The caller's step number (``step(step=)``), else ``None``."""
    t0: float
    """``perf_counter`` at the start of the step's window."""
    t1: float
    """``perf_counter`` at its end."""
    phases: dict[str, float]
    """Host-clock phase seconds."""
    samples: Any
    tokens: Any
    flops: Any
    """The counts as given to ``step()``; checked by the sender's encoder, not here."""
    memory: MemoryTuple | Mapping[str, int] | None
    """From CUDA's allocator, else as given to ``step(memory=)``."""
    marks: list[Mark] | None
    """The phases' CUDA events (``None`` without CUDA; empty on a host-timed step)."""
    measured: dict[str, object] | None
    """Measured fields the monitor's extensions added (``comm``, ``memb``, ``cpu_wait``)."""


SEQ, STEP, T0, T1, PHASES, SAMPLES, TOKENS, FLOPS, MEMORY, MARKS, MEASURED = (
    StepFields._fields.index(name) for name in (
        "seq", "step", "t0", "t1", "phases", "samples", "tokens", "flops", "memory", "marks",
        "measured"))
"""Each field's index in a ``StepTuple``."""
