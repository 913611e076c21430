"""What a record may hold: sizes, ranges and label rules, in one table.

``FIELD_LIMITS`` is the only statement of each numeric field's type and range: the decoder's
fast path takes its bounds from it, its full check applies it, and the client's encoder
checks what it sends against the same rows. ``tests/wire/test_limits.py`` holds the two
decoder paths to the same verdict on any input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PROTOCOL_VERSION = 1
MAX_DATAGRAM_BYTES = 8192
MAX_RECORDS_PER_DATAGRAM = 256

KNOWN_PHASES = ("data", "forward", "backward", "comm", "optimizer")
"""Phases the agent attributes to a wall; any other label counts as ``other``."""
PARALLEL_DIMS = ("dp", "tp", "pp", "ep", "cp")
"""The dimensions of a job's parallelism a rank's layout names (data, tensor, pipeline, expert,
context), in wire and label order."""
MAX_OTHER_DIMS = 8
"""Most dimensions of other names (a mesh's, as the job named them) a layout may carry."""
MEMORY_COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "other")
"""The parts of a rank's memory the sampled breakdown (``memb``) names, in wire and field order."""
STEP_MEASURED_FIELDS = ("comm", "memb", "cpu_wait", "moe")
"""Optional step fields a watcher on the training thread may add (``encode_measured_field``)."""

MAX_RUN_CHARS = 128
MAX_LABEL_CHARS = 64
"""Longest phase or event name, and the client version."""
MAX_GPU_CHARS = 128
MAX_COLLECTIVE_CHARS = 32
"""Longest collective kind name (``all_reduce``, ``reduce_scatter``, ...)."""
MAX_MESSAGE_CHARS = 1024
MAX_PHASES = 32
MAX_COLLECTIVE_KINDS = 16
"""Most kinds of collective one step's ``comm`` may list."""
MAX_STACK_FRAMES = 48
"""Most frames a ``state`` record's stack may hold (the innermost are kept)."""
MAX_FRAME_TEXT_CHARS = 128
"""Longest file or function name in a stack frame (a file keeps its last path components)."""

MAX_MOE_LAYERS = 64
"""Most MoE layers one step's ``moe`` may summarise: a 64-layer summary of 4096-expert layers
with 32-character names still leaves a typical record under ``MAX_DATAGRAM_BYTES``."""
MAX_MOE_LAYER_CHARS = 32
"""Longest MoE layer name (``3``, ``model.layers.3``, what ``expert_load`` was told)."""
MAX_EXPERTS = 4096
"""Most experts one MoE layer may have."""
MAX_MOE_WINDOW = 10_000
"""Longest window of steps an expert-load summary may cover."""
MOE_RATIO_SLACK = 1e-3
"""How far a summary's ratio or CV may pass its bound (rounding by clients)."""

MAX_WORLD_SIZE = 1 << 20
"""Largest accepted world size; rank and local_rank must be below it."""
MAX_GPU_INDEX = 4096
MAX_INT = (1 << 63) - 1
MAX_PID = (1 << 32) - 1
MAX_DURATION_S = 86_400.0
"""A step (or phase) must last less than a day."""
PHASE_SLACK_RATIO = 0.01
PHASE_SLACK_S = 0.001
"""A phase (or a comm figure) may exceed its step's duration by this much (rounding by clients)."""
MAX_UNIX_TIME_S = 1e10
MAX_FLOPS = 1e30

DROP_REASONS = (
    "too_large",
    "not_utf8",
    "not_json",
    "not_object",
    "too_many_records",
    "bad_version",
    "bad_kind",
    "missing_field",
    "bad_type",
    "bad_value",
    "bad_label",
    "bad_comm",
    "bad_memory_breakdown",
    "bad_device_phases",
    "bad_state",
    "bad_stack",
    "bad_parallel",
    "bad_span",
    "bad_moe",
)
"""Every reason ``decode_datagram`` can give for a rejected object or datagram."""


@dataclass(frozen=True, slots=True)
class Limit:
    """One numeric field: an ``int`` (bool refused), or a number (an int or a finite float),
    from ``low`` to ``high`` (``high`` itself excluded when ``below``); ``within_step``: up to
    the step's duration plus the phase slack instead of ``high``. A wrong type is refused with
    ``type_reason``, a value out of range with ``value_reason``."""

    integer: bool
    high: float
    low: int = 0
    below: bool = False
    within_step: bool = False
    type_reason: str = "bad_type"
    value_reason: str = "bad_value"

    def high_for(self, duration_s: float) -> float:
        """The upper bound in a step lasting ``duration_s``."""
        return step_slack(duration_s) if self.within_step else self.high


def step_slack(duration_s: float) -> float:
    """The longest a phase or comm figure may be in a step of ``duration_s``."""
    return duration_s * (1 + PHASE_SLACK_RATIO) + PHASE_SLACK_S


_COUNT = Limit(integer=True, high=MAX_INT)


def _in_comm(integer: bool, high: float, within_step: bool = False) -> Limit:
    return Limit(integer, high, within_step=within_step, type_reason="bad_comm", value_reason="bad_comm")


def _in_moe(integer: bool, high: float, low: int = 0) -> Limit:
    return Limit(integer, high, low=low, type_reason="bad_moe", value_reason="bad_moe")


FIELD_LIMITS: dict[str, Limit] = {
    "rank": Limit(integer=True, high=MAX_WORLD_SIZE - 1),
    "world": Limit(integer=True, high=MAX_WORLD_SIZE, low=1),
    "local_rank": Limit(integer=True, high=MAX_WORLD_SIZE - 1),
    "step": _COUNT,
    "duration": Limit(integer=False, high=MAX_DURATION_S, below=True),
    "t_start": Limit(integer=False, high=MAX_UNIX_TIME_S),
    "t": Limit(integer=False, high=MAX_UNIX_TIME_S),
    "samples": _COUNT,
    "tokens": _COUNT,
    "flops": Limit(integer=False, high=MAX_FLOPS),
    "pid": Limit(integer=True, high=MAX_PID, low=1),
    "gpu": Limit(integer=True, high=MAX_GPU_INDEX - 1),
    "phase": Limit(integer=False, high=MAX_DURATION_S, within_step=True),
    "mem": _COUNT,
    "comm.exposed": _in_comm(integer=False, high=MAX_DURATION_S, within_step=True),
    "comm.busy": _in_comm(integer=False, high=MAX_DURATION_S, within_step=True),
    "comm.bubble": _in_comm(integer=False, high=MAX_DURATION_S, within_step=True),
    "comm.count": _in_comm(integer=True, high=MAX_INT),
    "comm.bytes": _in_comm(integer=True, high=MAX_INT),
    "comm.seconds": _in_comm(integer=False, high=MAX_DURATION_S),
    "cpu_wait": Limit(integer=False, high=MAX_DURATION_S, within_step=True),
    "zero_stage": Limit(integer=True, high=3),
    "parallel": Limit(integer=True, high=MAX_WORLD_SIZE - 1, type_reason="bad_parallel",
                      value_reason="bad_parallel"),
    "memb": Limit(integer=True, high=MAX_INT, type_reason="bad_memory_breakdown",
                  value_reason="bad_memory_breakdown"),
    "since": Limit(integer=False, high=MAX_UNIX_TIME_S),
    "threshold": Limit(integer=False, high=MAX_DURATION_S, below=True),
    "seconds": Limit(integer=False, high=MAX_DURATION_S, below=True),
    "launched": _COUNT,
    "bytes": _COUNT,
    "flight.seq": Limit(integer=True, high=MAX_INT, type_reason="bad_state", value_reason="bad_state"),
    "flight.bytes": Limit(integer=True, high=MAX_INT, type_reason="bad_state", value_reason="bad_state"),
    "flight.since": Limit(integer=False, high=MAX_UNIX_TIME_S, type_reason="bad_state",
                          value_reason="bad_state"),
    "moe.window": _in_moe(integer=True, high=MAX_MOE_WINDOW, low=1),
    "moe.experts": _in_moe(integer=True, high=MAX_EXPERTS, low=1),
    "moe.tokens": _in_moe(integer=True, high=MAX_INT, low=1),
    "moe.max_ratio": _in_moe(integer=False, high=MAX_EXPERTS + MOE_RATIO_SLACK, low=1),
    "moe.cv": _in_moe(integer=False, high=64.0),
    "moe.dead": _in_moe(integer=True, high=MAX_EXPERTS - 1),
    "frame.line": Limit(integer=True, high=MAX_INT, type_reason="bad_stack", value_reason="bad_stack"),
}
"""Every numeric field by name (``mem``, ``memb``: each of their counts; ``phase``: each phase;
``comm.*``: the figures inside ``comm``; ``cpu_wait``: seconds the training thread was
runnable but waiting for a CPU; ``since``, ``threshold``, ``launched``, ``flight.*`` and
``frame.line``: a ``state`` record's; ``seconds`` and ``bytes``: a ``span`` record's; ``moe.*``:
the figures of one layer of a step's expert-load summary, ``moe.window`` the steps it covers;
``zero_stage``: a hello's ZeRO stage; ``parallel``: each
coordinate of a hello's layout)."""

LABEL_LIMITS: dict[str, int] = {
    "run": MAX_RUN_CHARS,
    "phase": MAX_LABEL_CHARS,
    "event": MAX_LABEL_CHARS,
    "api": MAX_LABEL_CHARS,
    "client_version": MAX_LABEL_CHARS,
    "framework": MAX_LABEL_CHARS,
    "parallel": MAX_LABEL_CHARS,
    "gpu": MAX_GPU_CHARS,
    "collective": MAX_COLLECTIVE_CHARS,
    "dev": MAX_LABEL_CHARS,
    "layer": MAX_MOE_LAYER_CHARS,
}
"""Longest value of each label field; every label is ``[A-Za-z0-9_.:/-]+``. ``dev`` (the
phases a step timed on the GPU) lists names of its own ``phases``, each once, so it holds at
most ``MAX_PHASES``; anything else in it is ``bad_device_phases``."""

_LABEL = re.compile(r"[A-Za-z0-9_.:/-]+")


def is_label(value: str, max_chars: int = MAX_LABEL_CHARS) -> bool:
    """Whether ``value`` may be a run or phase name: 1..max_chars of ``[A-Za-z0-9_.:/-]``."""
    return 0 < len(value) <= max_chars and _LABEL.fullmatch(value) is not None
