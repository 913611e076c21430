"""The rank store's bounds: a fair cap between senders, ownership of a (run, rank), and values
that would break a counter or a timestamp for good."""

from __future__ import annotations

import pytest

from gpumon.collectors.samples import SenderCredentials
from gpumon.state.ranks import IDLE_EVICT_S, MAX_CLOCK_SKEW_S, RankStore
from gpumon.wire import EventRecord, HelloRecord, StepRecord

NOW = 1_800_000_000.0
ALICE, MALLORY = SenderCredentials(pid=100, uid=1000), SenderCredentials(pid=666, uid=1666)


def hello(run: str, rank: int) -> HelloRecord:
    return HelloRecord(run=run, rank=rank)


def step(run: str, rank: int, **fields: object) -> StepRecord:
    values: dict = {"step": 0, "duration_s": 0.5, "t_start": NOW - 0.5, **fields}
    return StepRecord(run=run, rank=rank, **values)


def live(store: RankStore, run: str) -> list[int]:
    return sorted(s.rank for s in store.ranks() if s.run == run)


def test_a_flood_from_one_sender_leaves_room_for_another() -> None:
    store = RankStore(max_ranks=100)
    store.ingest([hello(f"spam-{i // 10}", i % 10) for i in range(140)], MALLORY, 0.0, NOW)
    assert store.counters()[1] == {"too_many_ranks": 40}
    accepted = store.ingest([step("job", r) for r in range(8)], ALICE, 1.0, NOW)
    assert [r.rank for r in accepted] == list(range(8))
    assert store.evictions() == {"over_share": 8}
    # The least recently reporting of the flood went, and the expiry pass says so.
    assert set(store.expire(1.0)) == {("spam-0", r) for r in range(8)}
    # Alice may take up to her share (half the cap) even while the flood goes on ...
    store.ingest([hello(f"spam-{i}", 0) for i in range(20, 60)], MALLORY, 2.0, NOW)
    store.ingest([step("job", r) for r in range(8, 50)], ALICE, 3.0, NOW)
    assert live(store, "job") == list(range(50))
    # ... and no more than that while Mallory holds the other half, fresh.
    store.ingest([step("job", 50)], ALICE, 4.0, NOW)
    assert live(store, "job") == list(range(50))
    assert store.counters()[1]["too_many_ranks"] == 40 + 40 + 1


def test_a_sweep_of_short_runs_replaces_its_own_quiet_pairs() -> None:
    store = RankStore(ttl_s=300.0, max_ranks=4)
    for n in range(4):
        store.ingest([step(f"sweep-{n}", 0)], ALICE, float(n), NOW)
    store.ingest([step("sweep-4", 0)], ALICE, 10.0, NOW)  # all four still fresh: refused
    assert store.counters()[1] == {"too_many_ranks": 1}
    store.ingest([step("sweep-4", 0)], ALICE, IDLE_EVICT_S + 0.5, NOW)  # sweep-0 is quiet
    assert sorted(s.run for s in store.ranks()) == [f"sweep-{n}" for n in range(1, 5)]
    assert store.evictions() == {"idle": 1}


def test_a_rank_belongs_to_the_uid_that_first_reported_it() -> None:
    store = RankStore(ttl_s=60.0)
    store.ingest([step("job", 0, flops=1e12)], ALICE, 0.0, NOW)
    forged = [EventRecord(run="job", rank=0, event="oom"), step("job", 0, step=1, flops=1e13),
              HelloRecord(run="job", rank=0, local_rank=7)]
    assert store.ingest(forged, MALLORY, 1.0, NOW) == []
    assert store.counters()[1] == {"not_owner": 3}
    (state,) = store.ranks()
    assert (state.ooms_total, state.steps_total, state.flops_total) == (0, 1, 1e12)
    assert (state.pid, state.uid, state.local_rank) == (100, 1000, None)
    # Once the owner's pair has expired, the name is free again.
    store.expire(120.0)
    assert store.ingest([step("job", 0)], MALLORY, 120.0, NOW)
    assert store.ranks()[0].uid == 1666


@pytest.mark.parametrize(("fields", "reason"), [
    ({"t_start": NOW + 86_400.0}, "clock_skew"),
    ({"t_start": NOW - MAX_CLOCK_SKEW_S - 60.0}, "clock_skew"),
    ({"flops": 1e30}, "implausible_flops"),
    ({"flops": 1e19, "duration_s": 0.0}, "implausible_flops"),
    ({"tokens": 10**17}, "implausible_count"),
    ({"samples": 10**17}, "implausible_count"),
])
def test_values_that_would_break_a_counter_or_a_timestamp_are_dropped(
        fields: dict, reason: str) -> None:
    store = RankStore()
    store.ingest([step("job", 0, flops=1e12, tokens=4096)], ALICE, 0.0, NOW)
    assert store.ingest([step("job", 0, step=1, **fields)], ALICE, 1.0, NOW) == []
    assert store.counters()[1] == {reason: 1}
    (state,) = store.ranks()
    assert (state.steps_total, state.flops_total, state.tokens_total) == (1, 1e12, 4096)
    assert state.last_step_end_t == NOW


def test_plausible_extremes_are_kept() -> None:
    store = RankStore()
    # A whole 1,000-GPU job's FLOPs reported on one rank, a step ending 4 minutes ago.
    big = step("job", 0, flops=4e17 * 2.0, duration_s=2.0, t_start=NOW - 240.0, tokens=2**24)
    assert store.ingest([big], ALICE, 0.0, NOW) == [big]
