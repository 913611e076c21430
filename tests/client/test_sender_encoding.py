"""The sender's hand-formatted step records: whatever the phases and counts, what it writes
is a record the agent accepts, with the values the training loop measured (clamped where the
protocol demands it)."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterator

import pytest

from gpumon.client._sender import MAX_PHASE_TEMPLATES, Sender, StepTuple
from gpumon.client.transport import MemoryTransport
from gpumon.wire import MAX_PHASES, StepRecord, decode_datagram

HEADER: dict[str, object] = {"v": 1, "run": "enc-test", "rank": 3, "world": 8, "pid": 42, "kind": "step"}


@pytest.fixture
def sender() -> Iterator[Sender]:
    s = Sender(MemoryTransport(), HEADER, {**HEADER, "kind": "hello"}, deque())
    yield s
    s.close()


def encode(sender: Sender, phases: dict[str, float], duration: float = 0.01, **fields: object) -> StepRecord:
    """One step through the sender's formatter, decoded as the agent decodes it."""
    item: StepTuple = (7, fields.get("step"), 100.0, 100.0 + duration, phases, fields.get("samples"),
                       fields.get("tokens"), fields.get("flops"), None, None,
                       fields.get("measured"))  # type: ignore[assignment]
    result = decode_datagram(sender._encode_step(item, phases, 1.7e9).encode())
    assert result.rejected == []
    [record] = result.records
    assert isinstance(record, StepRecord)
    return record


def test_the_header_and_numbers_round_trip(sender: Sender) -> None:
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
def test_phases_outside_the_step_are_clamped(sender: Sender, seconds: float, sent: float) -> None:
    # GPU-timed phases can outlast the host window of their step; NaN must not reach the wire.
    for _ in range(2):  # the first step builds the template, the second uses it
        r = encode(sender, {"data": 0.001, "forward": seconds})
        assert r.phases_s == {"data": pytest.approx(0.001), "forward": pytest.approx(sent)}


def test_phase_order_and_sets_may_change_from_step_to_step(sender: Sender) -> None:
    rng = random.Random(5)
    names = ["data", "forward", "backward", "comm", "optimizer", "my.custom/phase-1"]
    for _ in range(300):
        chosen = rng.sample(names, rng.randint(1, len(names)))
        phases = {name: rng.uniform(0.0, 0.002) for name in chosen}
        r = encode(sender, phases)
        assert list(r.phases_s) == chosen
        assert r.phases_s == pytest.approx(phases, rel=1e-8)


def test_too_many_phases_fold_into_other(sender: Sender) -> None:
    phases = {f"p{i}": 0.0001 for i in range(MAX_PHASES + 5)}
    r = encode(sender, phases)
    assert len(r.phases_s) == MAX_PHASES
    assert r.phases_s["other"] == pytest.approx(0.0001 * 6)


def test_the_template_cache_stays_bounded(sender: Sender) -> None:
    for i in range(3 * MAX_PHASE_TEMPLATES):
        r = encode(sender, {f"phase{i}": 0.001, "forward": 0.002})
        assert r.phases_s == {f"phase{i}": pytest.approx(0.001), "forward": pytest.approx(0.002)}
    assert len(sender._phase_templates) <= MAX_PHASE_TEMPLATES


def test_invalid_counts_are_left_out_and_counted(sender: Sender) -> None:
    r = encode(sender, {}, samples=-1, tokens=True, flops=math.nan, step=-3)
    assert (r.samples, r.tokens, r.flops, r.step) == (None, None, None, 7)
    assert sender.invalid_fields == 4
