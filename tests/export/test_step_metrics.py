"""Step, communication and verdict families: their values, and kept as text per run between
scrapes, byte for byte a fresh render."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest

from gpumon.analysis.stream import StepAnalyzer
from gpumon.collectors.samples import ProcessSample, SenderCredentials
from gpumon.export.exposition import render
from gpumon.export.step_metrics import StepFamilies
from gpumon.state.ranks import RankStore
from gpumon.testing import Metrics
from gpumon.wire import (
    CollectiveOp,
    CommStats,
    EventRecord,
    HelloRecord,
    MemoryStats,
    ParallelLayout,
    Record,
    StepRecord,
    decode_datagram,
)
from tests.helpers import (
    library_agent,
    parse_metrics,
    scrape_metrics,
    value,
    values,
    wait_for,
)

TTL_S = 60.0


class Node:
    """A step store and an analyzer fed as the agent feeds them, and their scrape inputs."""

    def __init__(self) -> None:
        self.store = RankStore(ttl_s=TTL_S)
        self.analyzer = StepAnalyzer(resolution_s=1.0, ranks=self.store)
        self.t = 1_000_000.0
        self.monotonic = 0.0
        self.processes: dict[int, ProcessSample] = {}
        self.resolved: dict[tuple[str, int], str] = {}

    def ingest(self, records: list[Record]) -> None:
        accepted = self.store.ingest(records, SenderCredentials(), self.monotonic, self.t)
        self.analyzer.add(accepted, self.t)

    def housekeeping(self) -> None:
        self.store.expire(self.monotonic)
        self.analyzer.process(self.t, lambda index, t0, t1: [], [], {}, self.store.layouts())

    def scrape(self, families: StepFamilies) -> bytes:
        ranks = self.store.ranks()
        return render([*families.steps(ranks, *self.store.counters(), self.processes,
                                       self.resolved),
                       *families.analyses(ranks)])


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
    comm = None
    if rng.random() < 0.4:
        exposed = duration_s * rng.choice([0.0, 0.05, 0.3])
        comm = CommStats(exposed, exposed + duration_s * 0.2, tuple(
            CollectiveOp(name, rng.randrange(1, 9), rng.randrange(2**20, 2**30), duration_s * 0.1)
            for name in rng.sample(["all_reduce", "all_gather", "broadcast"], rng.randrange(3))))
    return StepRecord(run=run, rank=rank, step=n, duration_s=duration_s,
                      t_start=t_end - duration_s, phases_s=phases, world=4,
                      samples=rng.choice([None, 32]), tokens=rng.choice([None, 65536]),
                      flops=rng.choice([None, 3.1e15]), gpu=rank % 2, pid=100 + rank, mem=mem,
                      comm=comm)


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


# --- communication and the straggler comparison ----------------------------------------------

GRADIENTS = 64 * 2**20


def ddp_step(rank: int, n: int, t_end: float, *, world: int = 4, exposed: float = 0.05,
             busy: float = 0.08, comm_phase: float | None = None,
             measured: bool = True) -> StepRecord:
    phases = {"data": 0.002, "forward": 0.03, "backward": 0.06, "optimizer": 0.008}
    if comm_phase is not None:
        phases["comm"] = comm_phase
    comm = CommStats(exposed, busy, (CollectiveOp("all_reduce", 4, GRADIENTS, 0.04),
                                     CollectiveOp("broadcast", 1, 1024, 0.001))) \
        if measured else None
    return StepRecord(run="ddp", rank=rank, step=n, duration_s=0.12, world=world,
                      t_start=t_end - 0.12, phases_s=phases, comm=comm)


def test_communication_series_per_rank_and_collective_kind() -> None:
    node = Node()
    for n in range(20):
        node.t += 0.12
        node.ingest([ddp_step(0, n, node.t),  # measured
                     ddp_step(1, n, node.t, comm_phase=0.02, exposed=0.03),  # both: not added
                     ddp_step(2, n, node.t, comm_phase=0.01, measured=False),  # hand-timed only
                     ddp_step(3, n, node.t, measured=False)])  # neither
    metrics = parse_metrics(node.scrape(StepFamilies()).decode())

    def get(name: str, rank: int, **labels: str) -> float | None:
        found = values(metrics, name, run="ddp", rank=str(rank), **labels)
        assert len(found) <= 1
        return found[0] if found else None

    assert get("gpumon_comm_exposed_seconds_total", 0) == pytest.approx(20 * 0.05)
    assert get("gpumon_comm_exposed_seconds_total", 1) == pytest.approx(20 * 0.03)
    assert get("gpumon_comm_exposed_seconds_total", 2) == pytest.approx(20 * 0.01)
    assert get("gpumon_comm_exposed_seconds_total", 3) is None  # nothing known: absent
    assert get("gpumon_comm_overlapped_seconds_total", 0) == pytest.approx(20 * 0.03)
    assert get("gpumon_comm_overlapped_seconds_total", 2) is None
    assert get("gpumon_collective_operations_total", 0, op="all_reduce") == 80
    assert get("gpumon_collective_bytes_total", 0, op="all_reduce") == 20 * GRADIENTS
    assert get("gpumon_collective_seconds_total", 0, op="all_reduce") == pytest.approx(0.8)
    assert get("gpumon_collective_operations_total", 2, op="all_reduce") is None
    # nccl-tests: all-reduce busbw = algbw x 2(n-1)/n (1.5 at 4 ranks); broadcast x 1
    assert get("gpumon_collective_bus_bandwidth_bytes_per_second", 0, op="all_reduce") \
        == pytest.approx(GRADIENTS / 0.04 * 1.5)
    assert get("gpumon_collective_bus_bandwidth_bytes_per_second", 0, op="broadcast") \
        == pytest.approx(1024 / 0.001)


def test_bus_bandwidth_follows_the_latest_steps_and_needs_a_world_size() -> None:
    node = Node()
    for n in range(40):
        node.t += 0.12
        slow = n >= 20  # the link degrades: the same bytes take four times as long
        record = ddp_step(0, n, node.t, world=2)
        assert record.comm is not None
        ops = (CollectiveOp("all_reduce", 4, GRADIENTS, 0.16 if slow else 0.04),)
        node.ingest([StepRecord(**{**{f: getattr(record, f) for f in record.__slots__},
                                   "comm": CommStats(0.05, 0.08, ops)}),
                     StepRecord(run="ddp", rank=1, step=n, duration_s=0.12, t_start=node.t - 0.12,
                                comm=CommStats(0.05, 0.08, ops))])  # no world reported
    metrics = parse_metrics(node.scrape(StepFamilies()).decode())
    assert value(metrics, "gpumon_collective_bus_bandwidth_bytes_per_second", run="ddp",
                 rank="0", op="all_reduce") == pytest.approx(GRADIENTS / 0.16)
    assert not values(metrics, "gpumon_collective_bus_bandwidth_bytes_per_second", run="ddp",
                      rank="1", op="all_reduce")
    assert value(metrics, "gpumon_collective_bytes_total", run="ddp", rank="1",
                 op="all_reduce") == 40 * GRADIENTS


def test_straggler_cause_and_world_changes() -> None:
    node = Node()
    for n in range(50):  # after the restart, enough steps for the straggler's window
        node.t += 0.2
        world = 4 if n < 20 else 3  # an elastic restart drops rank 3
        records = []
        for rank in range(world):
            slow = rank == 1
            records.append(ddp_step(rank, n, node.t, world=world, exposed=0.0 if slow else 0.06,
                                    busy=0.05))
        node.ingest(records)
        node.housekeeping()
    node.t += 10
    node.housekeeping()
    metrics = parse_metrics(node.scrape(StepFamilies()).decode())

    def get(name: str, rank: int, **labels: str) -> float | None:
        found = values(metrics, name, run="ddp", rank=str(rank), **labels)
        assert len(found) <= 1
        return found[0] if found else None

    assert get("gpumon_rank_straggler_cause", 1, cause="compute") == 1
    assert sum(get("gpumon_rank_straggler_cause", 0, cause=c) or 0
               for c in ("input", "compute", "gpu", "unknown")) == 0
    assert get("gpumon_rank_straggler_cause", 3, cause="compute") is None  # not compared
    assert [get("gpumon_rank_world_changes_total", r) for r in range(4)] == [1, 1, 1, 0]
    assert get("gpumon_step_flag", 1, flag="straggler") == 1
    assert get("gpumon_step_flag", 0, flag="straggler") == 0


def test_bad_comm_figures_are_dropped_and_counted_by_a_live_agent(tmp_path: Path) -> None:
    """Over the real socket: comm figures beyond the step's duration, negative or NaN are
    refused as bad_comm, the good records beside them kept, and the agent keeps serving."""
    good = {"v": 1, "kind": "step", "run": "ddp", "rank": 0, "world": 2, "step": 1,
            "duration": 0.1, "comm": {"exposed": 0.05, "busy": 0.07,
                                      "ops": {"all_reduce": [2, 1024, 0.06]}}}
    bad = [{**good, "step": 2, "comm": {"exposed": 0.5, "busy": 0.5}},
           {**good, "step": 3, "comm": {"exposed": -0.01, "busy": 0.0}},
           {**good, "step": 4, "comm": {"exposed": 0.01, "busy": 0.01,
                                        "ops": {"all_reduce": [1, 8, -1.0]}}}]
    nan = json.dumps({**good, "step": 5}).replace('"busy": 0.07', '"busy": NaN')
    assert decode_datagram(nan.encode()).rejected == ["bad_comm"]
    with library_agent(tmp_path / "ingest.sock", simulate=1, interval=0.25) as agent:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.sendto(json.dumps([good, *bad]).encode(), str(tmp_path / "ingest.sock"))
        sock.sendto(nan.encode(), str(tmp_path / "ingest.sock"))
        sock.close()

        def dropped() -> Metrics | None:
            metrics = scrape_metrics(agent)
            counts = values(metrics, "gpumon_ingest_dropped_total", reason="bad_comm")
            return metrics if counts == [4] else None

        metrics = wait_for(dropped, timeout=10, what="four bad_comm drops")
        assert value(metrics, "gpumon_steps_total", run="ddp", rank="0") == 1
        assert value(metrics, "gpumon_comm_exposed_seconds_total", run="ddp",
                     rank="0") == pytest.approx(0.05)


def pipeline_step(rank: int, n: int, t_end: float, *, stage_work: float,
                  bubble: float) -> StepRecord:
    """A step of a pipeline stage that works ``stage_work`` s and waits ``bubble`` s to
    receive from its neighbour (its exposed communication is that wait)."""
    duration = stage_work + bubble
    return StepRecord(run="pp", rank=rank, step=n, duration_s=duration, world=4,
                      t_start=t_end - duration,
                      phases_s={"forward": duration * 0.4, "backward": duration * 0.6},
                      comm=CommStats(bubble, bubble, (CollectiveOp("recv", 4, 4096, bubble),
                                                      CollectiveOp("send", 4, 4096, 0.001)),
                                     bubble_s=bubble))


def test_layout_bubble_and_stage_imbalance() -> None:
    """Two replicas of a two-stage pipeline: stage 1 works 0.3 s a step, stage 0 works 0.1 s and
    waits 0.2 s to receive. Each rank's layout is shown, each stage's bubble counted, the
    stages' own work set side by side and their imbalance given; no replica is a straggler."""
    node = Node()
    layouts = {rank: ParallelLayout(dp=rank % 2, pp=rank // 2, source="pipeline")
               for rank in range(4)}
    node.ingest([HelloRecord("pp", rank, 4, parallel=layout) for rank, layout in layouts.items()])
    for n in range(30):
        node.t += 0.3
        node.ingest([pipeline_step(rank, n, node.t, stage_work=0.1 if rank < 2 else 0.3,
                                   bubble=0.2 if rank < 2 else 0.0) for rank in range(4)])
        node.housekeeping()
    node.t += 10
    node.housekeeping()
    metrics = parse_metrics(node.scrape(StepFamilies()).decode())
    assert value(metrics, "gpumon_rank_parallel_info", run="pp", rank="3", dp="1", tp="",
                 pp="1", ep="", cp="") == 1
    assert value(metrics, "gpumon_pipeline_bubble_seconds_total", run="pp", rank="0") \
        == pytest.approx(30 * 0.2)
    assert value(metrics, "gpumon_pipeline_bubble_seconds_total", run="pp", rank="2") == 0
    assert value(metrics, "gpumon_pipeline_stage_own_seconds", run="pp", pp="0") \
        == pytest.approx(0.1)
    assert value(metrics, "gpumon_pipeline_stage_own_seconds", run="pp", pp="1") \
        == pytest.approx(0.3)
    assert value(metrics, "gpumon_pipeline_stage_imbalance_ratio", run="pp") \
        == pytest.approx(0.3 / 0.2)
    assert value(metrics, "gpumon_collective_operations_total", run="pp", rank="0",
                 op="recv") == 120
    for rank in range(4):
        assert value(metrics, "gpumon_rank_straggler_score", run="pp", rank=str(rank)) \
            == pytest.approx(1.0)
        assert value(metrics, "gpumon_step_flag", run="pp", rank=str(rank), flag="straggler") == 0
