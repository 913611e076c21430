"""The sender's common step records written in C (``_hook.format_step``) against the wire's
``StepEncoder``, which writes every record itself without it: the same text, the same fields
left out and counted, for any values a loop may pass."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.client.core import _hook, sender
from gpumon.client.monitor import IMPLEMENTATION
from gpumon.wire import MAX_PHASES, StepEncoder, decode_datagram
from gpumon.wire.step_encoder import LIMITS

_hook.set_step_limits(*LIMITS)  # as the sender does (not with GPUMON_PURE_PYTHON=1)


def test_the_sender_writes_with_it_where_the_core_is_c() -> None:
    assert sender._formatter is (_hook.format_step if IMPLEMENTATION == "c" else None)

MAX_STEP, MAX_COUNT, MAX_FLOPS, _ = LIMITS
names = st.sampled_from(["data", "forward", "backward", "optimizer", "comm", "eval", "a.b:c/d-e_f"])
seconds = st.one_of(st.floats(0, 0.02), st.floats(allow_nan=True, allow_infinity=True), st.integers(0, 3))
counts = st.one_of(st.none(), st.integers(-2, 2 ** 70), st.just(MAX_COUNT), st.just(MAX_COUNT + 1),
                   st.booleans(), st.floats(0, 100), st.just(2.0))
flops = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.just(MAX_FLOPS),
                  st.just(float(MAX_FLOPS) * 2), st.integers(0, 10 ** 20), st.booleans())
steps = st.one_of(st.none(), st.integers(-5, MAX_STEP + 5), st.just(MAX_STEP), st.booleans(), st.floats(0, 9))


def encoders(gpu: object = None) -> tuple[StepEncoder, StepEncoder]:
    fast = StepEncoder("fmt", 3, world=8, local_rank=1, pid=4242, gpu=gpu,  # type: ignore[arg-type]
                       formatter=_hook.format_step)
    plain = StepEncoder("fmt", 3, world=8, local_rank=1, pid=4242, gpu=gpu)  # type: ignore[arg-type]
    return fast, plain


@settings(max_examples=600, deadline=None)
@given(step=steps, default_step=st.integers(0, 10 ** 6), t_start=st.floats(1.6e9, 1.9e9),
       duration=st.one_of(st.floats(0, 0.02), st.floats(0, 86400)),
       phases=st.dictionaries(names, seconds, max_size=6), samples=counts, tokens=counts, flops=flops,
       measured=st.one_of(st.none(), st.just({"cpu_wait": 0.001}), st.just({"cpu_wait": -1.0})),
       gpu=st.one_of(st.none(), st.integers(0, 7), st.just("GPU-5e0c7dd2-0000-1111-2222-333344445555")))
def test_the_c_formatter_writes_what_the_encoder_writes(
    step: object, default_step: int, t_start: float, duration: float, phases: dict[str, float],
    samples: object, tokens: object, flops: object, measured: dict[str, object] | None, gpu: object,
) -> None:
    fast, plain = encoders(gpu)
    args = (step, default_step, t_start, duration, phases, samples, tokens, flops, None, measured)
    assert fast.encode(*args) == plain.encode(*args)  # type: ignore[arg-type]
    assert fast.invalid_fields == plain.invalid_fields


def test_a_common_record_takes_the_c_path_and_is_one_the_agent_accepts() -> None:
    fast, _ = encoders("GPU-5e0c7dd2-0000-1111-2222-333344445555")
    phases = {"data": 1e-05, "forward": 0.0031, "backward": 0.006, "optimizer": 0.0009}
    text = _hook.format_step(fast._prefix, None, 12, 1.7e9 + 0.25, 0.0101, phases, 64, None, 3.5e12)
    assert text is not None
    [record] = decode_datagram((text + "}").encode()).records
    assert record.step == 12 and record.phases_s == phases and record.samples == 64 and record.flops == 3.5e12


@pytest.mark.parametrize("change", [
    {"phases": {f"p{i}": 0.0 for i in range(MAX_PHASES + 1)}},  # folded into "other"
    {"phases": {"forward": 0.02}},  # longer than the step: clamped
    {"phases": {"forward": math.nan}},
    {"samples": True}, {"samples": -1}, {"flops": 7}, {"step": -1}, {"duration": 1},
])
def test_what_the_encoder_must_leave_out_or_fix_is_left_to_it(change: dict[str, object]) -> None:
    fast, _ = encoders()
    record: dict[str, object] = {"step": None, "default_step": 1, "t_start": 1.7e9, "duration": 0.01,
                                 "phases": {"forward": 0.001}, "samples": 8, "tokens": None, "flops": None}
    assert _hook.format_step(fast._prefix, *record.values()) is not None
    record.update(change)
    assert _hook.format_step(fast._prefix, *record.values()) is None
