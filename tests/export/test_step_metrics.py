"""Step and verdict families: kept as text per run between scrapes, byte for byte a fresh render."""

from __future__ import annotations

import random

import pytest

from gpumon.agent.ranks import RankStore
from gpumon.analysis.stream import StepAnalyzer
from gpumon.collectors.samples import ProcessSample, SenderCredentials
from gpumon.export.exposition import render
from gpumon.export.step_metrics import StepFamilies
from gpumon.wire import EventRecord, HelloRecord, MemoryStats, Record, StepRecord
from tests.helpers import parse_metrics, value

TTL_S = 60.0


class Node:
    """A step store and an analyzer fed as the agent feeds them, and their scrape inputs."""

    def __init__(self) -> None:
        self.store = RankStore(ttl_s=TTL_S)
        self.analyzer = StepAnalyzer(resolution_s=1.0)
        self.t = 1_000_000.0
        self.monotonic = 0.0
        self.processes: dict[int, ProcessSample] = {}
        self.resolved: dict[tuple[str, int], str] = {}

    def ingest(self, records: list[Record]) -> None:
        accepted = self.store.ingest(records, SenderCredentials(), self.monotonic, self.t)
        self.analyzer.add(accepted, self.t)

    def housekeeping(self) -> None:
        self.analyzer.forget(self.store.expire(self.monotonic))
        self.analyzer.process(self.t, lambda index, t0, t1: [], [], {})

    def scrape(self, families: StepFamilies) -> bytes:
        return render([*families.steps(self.store.ranks(), *self.store.counters(),
                                       self.processes, self.resolved),
                       *families.analyses(self.analyzer.analyses())])


def step(run: str, rank: int, n: int, t_end: float, rng: random.Random) -> StepRecord:
    duration_s = rng.choice([0.004, 0.3, 0.5, 2.0])
    phases = {"forward": duration_s * 0.4, "backward": duration_s * 0.5}
    if rng.random() < 0.5:
        phases[rng.choice(["data", "comm", "optimizer", "custom"])] = duration_s * 0.1
    mem = None
    if rng.random() < 0.7:
        mem = MemoryStats(allocated_bytes=rng.randrange(2**30, 2**36),
                          peak_bytes=rng.choice([None, rng.randrange(2**30, 2**36)]),
                          reserved_bytes=2**36, alloc_retries=rng.randrange(3), ooms=0)
    return StepRecord(run=run, rank=rank, step=n, duration_s=duration_s,
                      t_start=t_end - duration_s, phases_s=phases, world=4,
                      samples=rng.choice([None, 32]), tokens=rng.choice([None, 65536]),
                      flops=rng.choice([None, 3.1e15]), gpu=rank % 2, pid=100 + rank, mem=mem)


@pytest.mark.parametrize("seed", range(4))
def test_kept_text_matches_a_fresh_render_after_random_updates(seed: int) -> None:
    rng = random.Random(seed)
    node = Node()
    kept = StepFamilies()
    next_step: dict[tuple[str, int], int] = {}
    for _ in range(120):
        node.t += rng.choice([0.0, 0.3, 1.0])
        node.monotonic += rng.choice([0.0, 0.3, 1.0, TTL_S / 3])
        for _ in range(rng.choice([0, 0, 1, 3])):
            run, rank = rng.choice(["a", "b", 'c"q']), rng.randrange(4)
            what = rng.random()
            if what < 0.8:
                n = next_step.get((run, rank), 0) + rng.choice([1, 1, 2])
                next_step[(run, rank)] = n
                node.ingest([step(run, rank, n, node.t, rng)])
            elif what < 0.9:
                node.ingest([EventRecord(run=run, rank=rank, event="oom", t=node.t)])
            else:
                gpu = rng.choice(["0", "1", "GPU-x"])
                node.ingest([HelloRecord(run=run, rank=rank, world=rng.choice([4, 8]),
                                         local_rank=rank, gpu=gpu)])
        if rng.random() < 0.3:
            node.processes = {100 + r: ProcessSample(100 + r, rng.choice([1.5, 2.0]), 2**30)
                              for r in range(4) if rng.random() < 0.7}
        if rng.random() < 0.2:
            node.resolved = {(run, r): f"GPU-{rng.randrange(2)}"
                             for run in ("a", "b") for r in range(4) if rng.random() < 0.5}
        if rng.random() < 0.4:
            node.housekeeping()
        assert node.scrape(kept) == node.scrape(StepFamilies())
    steps, analyses = kept.runs_held()
    assert steps == len({s.run for s in node.store.ranks()})
    assert analyses == len({a.run for a in node.analyzer.analyses()})


def test_a_rank_that_steps_again_is_rendered_again_and_the_others_are_not() -> None:
    rng = random.Random(0)
    node = Node()
    families = StepFamilies()
    node.ingest([step(run, rank, 1, node.t, rng) for run in ("a", "b") for rank in range(3)])
    before = parse_metrics(node.scrape(families).decode())
    node.t += 1.0
    node.ingest([step("a", 1, 2, node.t, rng)])
    text = node.scrape(families).decode()
    after = parse_metrics(text)
    assert value(before, "gpumon_steps_total", run="a", rank="1") == 1
    assert value(after, "gpumon_steps_total", run="a", rank="1") == 2
    assert value(after, "gpumon_step_last_timestamp_seconds", run="a", rank="1") == node.t
    changed = {key for key in after if after[key] != before.get(key)}
    assert changed == {key for key in changed
                       if key[0] == "gpumon_ingest_records_total"
                       or {("rank", "1"), ("run", "a")} <= key[1]}
    assert len(changed) > 3
    assert text.encode() == node.scrape(StepFamilies())


def test_expired_ranks_disappear_and_their_text_is_dropped() -> None:
    rng = random.Random(0)
    node = Node()
    families = StepFamilies()
    node.ingest([step("old", rank, 1, node.t, rng) for rank in range(4)])
    node.monotonic += TTL_S / 2
    node.t += 10.0
    node.ingest([step("live", 0, n, node.t - 3 + n, rng) for n in range(1, 3)])
    node.housekeeping()
    assert 'run="old"' in node.scrape(families).decode()
    assert families.runs_held() == (2, 2)
    node.monotonic += TTL_S * 0.75  # past the TTL for "old", not for "live"
    node.housekeeping()
    text = node.scrape(families).decode()
    assert 'run="old"' not in text and 'run="live"' in text
    assert families.runs_held() == (1, 1)
    # Back after expiry: a new state from zero, never the text kept for the old one.
    node.ingest([step("old", 2, 9, node.t, rng)])
    metrics = parse_metrics(node.scrape(families).decode())
    assert value(metrics, "gpumon_steps_total", run="old", rank="2") == 1
    assert families.runs_held() == (2, 2)
