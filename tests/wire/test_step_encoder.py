"""The client's hand-formatted step records (``StepEncoder``): whatever the phases and counts,
what it writes is a record the agent accepts, with the values the training loop measured
(clamped where the protocol demands it)."""

from __future__ import annotations

import json
import math
import random

import pytest

from gpumon.wire import MAX_PHASES, MemoryStats, StepEncoder, StepRecord, decode_datagram, to_wire
from gpumon.wire.step_encoder import MAX_PHASE_TEMPLATES


@pytest.fixture
def sender() -> StepEncoder:
    return StepEncoder("enc-test", 3, world=8, pid=42)


def encode(
    sender: StepEncoder, phases: dict[str, float], duration: float = 0.01, **fields: object
) -> StepRecord:
    """One step through the client's formatter, decoded as the agent decodes it."""
    text = sender.encode(fields.get("step"), 7, 1.7e9 + 100.0, duration, phases, fields.get("samples"),
                         fields.get("tokens"), fields.get("flops"), fields.get("mem"), fields.get("measured"))
    result = decode_datagram(text.encode())
    assert result.rejected == []
    [record] = result.records
    assert isinstance(record, StepRecord)
    return record


def test_the_header_and_numbers_round_trip(sender: StepEncoder) -> None:
    r = encode(sender, {"forward": 0.004, "backward": 0.005}, samples=64, tokens=2**40, flops=1.5e15)
    assert (r.run, r.rank, r.world, r.step) == ("enc-test", 3, 8, 7)
    assert r.t_start == pytest.approx(1.7e9 + 100.0, abs=1e-6)
    assert r.duration_s == pytest.approx(0.01, rel=1e-9)
    assert r.phases_s == pytest.approx({"forward": 0.004, "backward": 0.005}, rel=1e-9)
    assert (r.samples, r.tokens, r.flops) == (64, 2**40, 1.5e15)


@pytest.mark.parametrize(
    ("seconds", "sent"),
    [(0.02, 0.01), (-0.001, 0.0), (math.nan, 0.0), (math.inf, 0.01), (-math.inf, 0.0), (0.003, 0.003)],
)
def test_phases_outside_the_step_are_clamped(sender: StepEncoder, seconds: float, sent: float) -> None:
    # GPU-timed phases can outlast the host window of their step; NaN must not reach the wire.
    for _ in range(2):  # the first step builds the template, the second uses it
        r = encode(sender, {"data": 0.001, "forward": seconds})
        assert r.phases_s == {"data": pytest.approx(0.001), "forward": pytest.approx(sent)}


def test_phase_order_and_sets_may_change_from_step_to_step(sender: StepEncoder) -> None:
    rng = random.Random(5)
    names = ["data", "forward", "backward", "comm", "optimizer", "my.custom/phase-1"]
    for _ in range(300):
        chosen = rng.sample(names, rng.randint(1, len(names)))
        phases = {name: rng.uniform(0.0, 0.002) for name in chosen}
        r = encode(sender, phases)
        assert list(r.phases_s) == chosen
        assert r.phases_s == pytest.approx(phases, rel=1e-8)


def test_too_many_phases_fold_into_other(sender: StepEncoder) -> None:
    phases = {f"p{i}": 0.0001 for i in range(MAX_PHASES + 5)}
    r = encode(sender, phases)
    assert len(r.phases_s) == MAX_PHASES
    assert r.phases_s["other"] == pytest.approx(0.0001 * 6)


def test_the_template_cache_stays_bounded(sender: StepEncoder) -> None:
    for i in range(3 * MAX_PHASE_TEMPLATES):
        r = encode(sender, {f"phase{i}": 0.001, "forward": 0.002})
        assert r.phases_s == {f"phase{i}": pytest.approx(0.001), "forward": pytest.approx(0.002)}
    assert len(sender._phase_templates) <= MAX_PHASE_TEMPLATES


def test_invalid_counts_are_left_out_and_counted(sender: StepEncoder) -> None:
    r = encode(sender, {}, samples=-1, tokens=True, flops=math.nan, step=-3)
    assert (r.samples, r.tokens, r.flops, r.step) == (None, None, None, 7)
    assert sender.invalid_fields == 4


def test_it_writes_what_to_wire_writes_for_the_same_record(sender: StepEncoder) -> None:
    sender.set_gpu("GPU-5e0c7dd2-0000-1111-2222-333344445555")
    comm = {"exposed": 0.002, "busy": 0.004, "ops": {"all_reduce": [3, 1 << 20, 0.005]}}
    text = sender.encode(None, 11, 1.7e9, 0.01, {"data": 0.001, "forward": 0.004}, 64, 128, 2.5e12,
                         (10, 20, 15, 0, 1), {"comm": comm, "memb": {"parameters": 4096}})
    [record] = decode_datagram(text.encode()).records
    assert json.loads(text) == to_wire(record)
    assert record.mem == MemoryStats(10, 20, 15, 0, 1)
    assert record.gpu == "GPU-5e0c7dd2-0000-1111-2222-333344445555" and record.step == 11
    assert record.comm is not None and record.comm.ops[0].bytes == 1 << 20
    assert sender.invalid_fields == 0


@pytest.mark.parametrize(
    ("mem", "sent", "invalid"),
    [
        ((1, 2, 3, 4, 5), MemoryStats(1, 2, 3, 4, 5), 0),
        ((1, 2, 3), None, 1),  # a short tuple: no mem field at all
        ({"allocated": 5, "peak": 7}, MemoryStats(allocated_bytes=5, peak_bytes=7), 0),
        ({"allocated": -5, "bogus": 1, "ooms": 2}, MemoryStats(ooms=2), 2),
        ("lots", None, 1),
    ],
)
def test_memory_readings_from_cuda_or_the_caller(
    sender: StepEncoder, mem: object, sent: MemoryStats | None, invalid: int
) -> None:
    r = encode(sender, {}, mem=mem)
    assert r.mem == sent and sender.invalid_fields == invalid
