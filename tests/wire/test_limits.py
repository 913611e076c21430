"""The limits table and the decoder's two paths: whatever a step record holds, the fast path
and the full check reach the same verdict (the same record, or the fast path steps aside and
the full check names the reason), at every bound the table states."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpumon.wire.decode as decode_module
from gpumon.wire import (
    FIELD_LIMITS,
    LABEL_LIMITS,
    MAX_COLLECTIVE_KINDS,
    MAX_PHASES,
    MEMORY_COMPONENTS,
    ProtocolError,
    StepEncoder,
    StepRecord,
    decode_record,
)
from gpumon.wire.decode import _check_step, _fast_step, check_int, check_number

# Labels the decoder has seen (the fast path trusts those) and some it must refuse. The
# 40-character one is a valid run or phase name but too long for a collective kind.
KNOWN = ["llama-7b", "forward", "backward", "all_reduce", "GPU-5e0c7dd2-0000-1111-2222-333344445555",
         "r" * 40, "p" * 64]
UNSEEN = ["fresh-run", "q" * 65, "q" * 129, "has space", "", "ünï"]


@pytest.fixture(autouse=True, scope="module")
def known_labels() -> None:
    """Teach the decoder the known labels the way ingest does: by decoding records."""
    for label in KNOWN:
        decode_record({"v": 1, "kind": "hello", "run": label, "rank": 0})
        decode_record({"v": 1, "kind": "step", "run": "llama-7b", "rank": 0, "step": 0,
                       "duration": 1.0, "comm": {"exposed": 0.0, "busy": 0.0,
                                                 "ops": {label[:32]: [1, 1, 0.0]}}})


def around(low: float, high: float, integer: bool) -> st.SearchStrategy[Any]:
    """Values at and beside a range's ends, of the right type and of wrong ones."""
    ints = sorted({int(e) + d for e in (low, high) for d in (-1, 0, 1) if abs(e) < 1e19})
    floats = [float(low), float(high), math.nextafter(float(high), math.inf),
              math.nextafter(float(high), -math.inf), -0.0, -1e-300]
    odd = [None, True, False, "1", [1], {}, math.nan, math.inf, -math.inf, 10**400, -1]
    return st.sampled_from(ints) | st.sampled_from(floats) | st.sampled_from(odd)


def usual(low: float, high: float, integer: bool) -> st.SearchStrategy[Any]:
    """Values well inside a range, of the type a client sends."""
    if integer:
        return st.integers(int(low), int(min(high, 2**40)))
    return st.floats(float(low), float(high), allow_nan=False, exclude_max=True)


def field(key: str, odd: bool, duration_s: float = 1.0) -> st.SearchStrategy[Any]:
    limit = FIELD_LIMITS[key]
    high = limit.high_for(duration_s)
    return (around if odd else usual)(limit.low, high, limit.integer)


labels = st.sampled_from(KNOWN + UNSEEN)
known = st.sampled_from(KNOWN)


@st.composite
def step_records(draw: st.DrawFn) -> dict[str, object]:
    """Mostly well-formed step records, so the fast path is exercised, with a field or two
    odd (at a bound, out of range, of another type), and optional ones absent."""
    odd = set(draw(st.lists(st.sampled_from(sorted(STEP_FIELDS)), max_size=2)))
    duration = draw(field("duration", "duration" in odd) | st.sampled_from([0.1, 0.5]))
    slack_of = float(duration) if type(duration) is float and 0 <= duration < 1e6 else 1.0
    obj: dict[str, object] = {"v": 1, "kind": "step", "duration": duration}
    for key in STEP_FIELDS:
        if key == "duration":
            continue
        if key not in odd and key not in ("run", "rank", "step") and draw(st.integers(0, 3)) == 0:
            continue  # an optional field left out
        obj[key] = draw(STEP_FIELDS[key](key in odd, slack_of))
    phases = obj.get("phases")
    if "dev" in obj and "dev" not in odd and type(phases) is dict:
        # well-formed: distinct names of the record's own phases
        obj["dev"] = draw(st.lists(st.sampled_from(sorted(phases)), unique=True)) if phases else []
    return obj


def _identity(key: str) -> Any:
    small = {"rank": st.integers(0, 3), "local_rank": st.integers(0, 3), "world": st.integers(4, 16)}
    return lambda odd, d: field(key, True) | st.integers(0, 20) if odd else small[key]


def _phases(odd: bool, d: float) -> st.SearchStrategy[Any]:
    seconds = field("phase", odd, d)
    if odd:
        return st.dictionaries(labels, seconds, max_size=3) | st.sampled_from(
            [{f"p{i}": 0.0 for i in range(MAX_PHASES + 1)}, [0.1], "x"])
    return st.dictionaries(known, seconds, max_size=3)


def _counts(key: str, names: list[str]) -> Any:
    def strategy(odd: bool, d: float) -> st.SearchStrategy[Any]:
        parts = st.dictionaries(st.sampled_from(names + (["new"] if odd else [])), field(key, odd),
                                max_size=len(names))
        return parts | st.sampled_from([3, "x", [1]]) if odd else parts
    return strategy


def _comm(odd: bool, d: float) -> st.SearchStrategy[Any]:
    figures = st.tuples(field("comm.count", odd), field("comm.bytes", odd),
                        field("comm.seconds", odd)).map(list)
    names = labels if odd else known
    ops = st.dictionaries(names, figures, max_size=3)
    if odd:
        ops = ops | st.sampled_from([{f"op{i}": [1, 1, 0.0] for i in range(MAX_COLLECTIVE_KINDS + 1)},
                                     {"all_reduce": [1, 2]}, {"all_reduce": (1, 2, 0.0)}, []])
    comm = st.fixed_dictionaries({"exposed": field("comm.exposed", odd, d),
                                  "busy": field("comm.busy", odd, d)}, optional={"ops": ops})
    return comm | st.sampled_from([[0.1], 0.0, {"exposed": 0.0}]) if odd else comm


STEP_FIELDS: dict[str, Any] = {
    "run": lambda odd, d: labels | st.sampled_from([7, None]) if odd else known,
    "rank": _identity("rank"),
    "world": _identity("world"),
    "local_rank": _identity("local_rank"),
    "step": lambda odd, d: field("step", odd),
    "duration": None,
    "t_start": lambda odd, d: field("t_start", odd),
    "samples": lambda odd, d: field("samples", odd),
    "tokens": lambda odd, d: field("tokens", odd),
    "flops": lambda odd, d: field("flops", odd),
    "gpu": lambda odd, d: field("gpu", True) | labels if odd else field("gpu", False) | known,
    "pid": lambda odd, d: field("pid", odd),
    "phases": _phases,
    "mem": _counts("mem", ["allocated", "reserved", "peak", "retries", "ooms"]),
    "comm": _comm,
    "memb": _counts("memb", list(MEMORY_COMPONENTS)),
    "cpu_wait": lambda odd, d: field("cpu_wait", odd, d),
}


def _dev(odd: bool, d: float) -> st.SearchStrategy[Any]:
    names = st.lists(labels | st.sampled_from([3, None, ["forward"]]), max_size=3)
    return names | st.sampled_from(["forward", {"forward": 1}, ["forward", "forward"]]) if odd else names


STEP_FIELDS["dev"] = _dev


def verdict(decode: Any, obj: dict[str, object]) -> object:
    try:
        return decode(obj)
    except ProtocolError as err:
        return err.reason


@settings(max_examples=1500, deadline=None)
@given(step_records())
def test_fast_path_and_full_check_agree(obj: dict[str, object]) -> None:
    fast = _fast_step(obj)
    full = verdict(_check_step, obj)
    if fast is not None:
        assert full == fast, "the fast path accepted what the full check refuses or reads otherwise"
    assert verdict(decode_record, obj) == full


def test_the_fast_path_takes_what_the_client_sends() -> None:
    # The property above would hold trivially if the fast path never accepted anything.
    # Labels join the fast path's known set only while it has room, and earlier tests may
    # have filled it: start from an empty set, as a fresh agent does.
    decode_module._KNOWN_LABELS.clear()
    encoder = StepEncoder("llama-7b", 1, world=8, local_rank=1, pid=4242,
                          gpu="GPU-5e0c7dd2-0000-1111-2222-333344445555")
    text = encoder.encode(None, 7, 1.7e9, 0.12, {"forward": 0.05, "backward": 0.06}, 32, 65536, 1.5e15,
                          (1, 2, 3, 0, 0), {"comm": {"exposed": 0.05, "busy": 0.08,
                                                     "ops": {"all_reduce": [4, 1 << 26, 0.07]}},
                                            "memb": {"parameters": 1 << 30}, "cpu_wait": 0.004},
                          device_phases=("backward", "forward"))
    obj = json.loads(text)
    _check_step(obj)  # the first record of a run takes the full check and makes its labels known
    fast = _fast_step(obj)
    assert isinstance(fast, StepRecord) and fast == _check_step(obj)
    assert fast.comm is not None and fast.memory_breakdown is not None and fast.mem is not None
    assert fast.device_phases == ("backward", "forward") and fast.cpu_wait_s == 0.004


@pytest.mark.parametrize("key", sorted(FIELD_LIMITS))
def test_every_row_is_applied_at_its_bounds(key: str) -> None:
    """Each numeric row refuses one past either end, with its own reasons."""
    limit = FIELD_LIMITS[key]

    def check(value: object, key: str, duration_s: float) -> float:
        return check_int(value, key) if limit.integer else check_number(value, key, duration_s)
    high = limit.high_for(1.0)
    if not limit.below:
        assert check(int(high) if limit.integer else high, key, 1.0) == high
    assert check(limit.low, key, 1.0) == limit.low
    past = int(high) + 1 if limit.integer else math.nextafter(high, math.inf)
    for bad in (limit.low - 1, past):
        with pytest.raises(ProtocolError) as err:
            check(bad, key, 1.0)
        assert err.value.reason == limit.value_reason
    with pytest.raises(ProtocolError) as err:
        check("1", key, 1.0)
    assert err.value.reason == limit.type_reason


def test_every_label_row_is_a_length() -> None:
    assert set(LABEL_LIMITS) == {"run", "phase", "event", "client_version", "framework", "gpu",
                                 "collective", "dev", "parallel", "api", "layer"}
    assert all(isinstance(n, int) and n > 0 for n in LABEL_LIMITS.values())
