"""The synthetic job: synchronous timelines, GPU counters that follow the steps, and the real
classifier's reading of both; then a short run through the real hook and socket."""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumon.analysis.bottleneck import Bottleneck, DeviceSpec, Flag, StepEvidence, classify
from gpumon.analysis.devices import resolve_peak_dram, resolve_peak_flops, resolve_peak_nvlink
from gpumon.analysis.straggler import RankWork, judge_run, own_work_s
from gpumon.analysis.window import summarize_gpu_window
from gpumon.sim.gpus import H100_SXM, H200_SXM, SimulatedSource, gpu_model
from gpumon.sim.job import (
    FLOPS_PER_STEP,
    GRADIENT_BYTES,
    Cycle,
    SimulatedJob,
    Timeline,
    check_job,
    comm_fields,
    gpu_activity,
)
from gpumon.sim.schedule import PhaseKind, Schedule, parse_schedule
from gpumon.wire import CommStats, MemoryStats, StepRecord, decode_datagram, decode_record

WORLD = 4
SLOW = WORLD - 1


def one_phase(kind: str, seconds: float = 30, extra: str = "") -> Schedule:
    return parse_schedule(f'[[phase]]\nkind = "{kind}"\nseconds = {seconds}\n{extra}')


def cycles(schedule: Schedule, count: int, world: int = WORLD) -> list[Cycle]:
    timeline = Timeline(schedule, world, H100_SXM.memory_total_bytes, t0=100.0, loop=False)
    found = [timeline.cycle(n, now=100.0) for n in range(count)]
    return [c for c in found if c is not None]


def phases_of(cycle: Cycle, rank: int) -> dict[str, float]:
    """The phases a rank times: its wait for the all-reduce is inside backward, as under DDP."""
    step = cycle.steps[rank]
    ready = cycle.starts[rank] + step.data_s + step.forward_s + step.backward_s
    return {"data": step.data_s, "forward": step.forward_s,
            "backward": step.backward_s + cycle.allreduce_end - ready,
            "optimizer": step.optimizer_s}


def comm_of(cycle: Cycle, rank: int) -> CommStats:
    """The ``comm`` field the rank reports, decoded as the agent decodes it."""
    wire = comm_fields(cycle, rank)
    record = decode_record({"v": 1, "kind": "step", "run": "t", "rank": rank, "step": 0,
                            "duration": cycle.end(rank) - cycle.starts[rank], "comm": wire})
    assert isinstance(record, StepRecord) and record.comm is not None
    return record.comm


def test_straggler_steps_last_as_long_as_its_peers_but_compute_more_and_wait_less() -> None:
    cycle = cycles(one_phase("straggler"), 10)[-1]
    durations = {cycle.end(r) - cycle.starts[r] for r in range(WORLD)}
    assert max(durations) - min(durations) < 1e-9  # synchronous data parallelism
    slow, peer = phases_of(cycle, SLOW), phases_of(cycle, 0)
    # What a hook sees in the phases: the same on every rank (the wait is inside backward)...
    hooked = [p["forward"] + p["backward"] + p["optimizer"] for p in (slow, peer)]
    assert hooked[0] == pytest.approx(hooked[1])
    # ...what the comm field says: the slow rank hardly waits, its peers wait for it.
    waits = {name: comm_of(cycle, rank).exposed_s for name, rank in (("slow", SLOW), ("peer", 0))}
    assert waits["slow"] < 0.05 * (cycle.end(SLOW) - cycle.starts[SLOW])
    own = {name: p["forward"] + p["backward"] + p["optimizer"] - waits[name]
           for name, p in (("slow", slow), ("peer", peer))}
    assert own["slow"] == pytest.approx(1.6 * own["peer"])  # slowdown 1.6
    assert waits["peer"] > waits["slow"] + 0.1


def test_straggler_rank_and_slowdown_come_from_the_phase() -> None:
    cycle = cycles(one_phase("straggler", extra="rank = 1\nslowdown = 2.0"), 3)[-1]
    assert [round(s.forward_s / cycle.steps[0].forward_s, 6) for s in cycle.steps] == [1, 2, 1, 1]


def test_steps_follow_each_other_without_gaps_and_switch_phase_on_time() -> None:
    schedule = parse_schedule('[[phase]]\nkind = "compute"\nseconds = 2\n'
                              '[[phase]]\nkind = "input"\nseconds = 2\n')
    found = cycles(schedule, 100)
    for before, after in zip(found, found[1:], strict=False):
        assert after.starts == tuple(before.end(r) for r in range(WORLD))
    kinds = [c.phase.kind for c in found]
    assert kinds[0] is PhaseKind.COMPUTE and kinds[-1] is PhaseKind.INPUT
    switch = kinds.index(PhaseKind.INPUT)
    assert found[switch].allreduce_start > 102.0 > found[switch - 1].starts[0]
    assert found[-1].end(0) < 100.0 + 4.0 + 0.6  # a single pass ends with the schedule


def test_leak_grows_every_steps_peak_toward_capacity() -> None:
    found = cycles(one_phase("leak", 20, "peak_ratio = 0.95"), 200)
    peaks = [c.steps[0].memory["peak"] for c in found]
    capacity = H100_SXM.memory_total_bytes
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    assert peaks[0] == pytest.approx(0.60 * capacity, rel=0.01)
    assert peaks[-1] == pytest.approx(0.95 * capacity, rel=0.02)
    activity = gpu_activity(found[-1], 0)
    assert found[-1].steps[0].memory["reserved"] < activity.memory_used_bytes < capacity
    flat = [c.steps[0].memory["peak"] for c in cycles(one_phase("compute"), 50)]
    assert len(set(flat)) == 1  # no trend outside a leak: no OOM prediction


def test_a_timeline_that_fell_behind_restarts_at_the_clock() -> None:
    timeline = Timeline(one_phase("compute"), 2, H100_SXM.memory_total_bytes, t0=0.0, loop=True)
    first = timeline.cycle(0, now=0.0)
    late = timeline.cycle(1, now=50.0)
    assert first is not None and late is not None
    assert late.starts[0] == pytest.approx(50.0 + first.steps[0].optimizer_s, abs=0.01)
    assert timeline.cycle(0, now=60.0) is first  # every rank gets the same cycle


EXPECTED = {
    PhaseKind.COMPUTE: Bottleneck.COMPUTE,
    PhaseKind.INPUT: Bottleneck.INPUT,
    PhaseKind.COMMUNICATION: Bottleneck.COMMUNICATION,
    PhaseKind.MEMORY_BANDWIDTH: Bottleneck.MEMORY_BANDWIDTH,
    PhaseKind.HOST: Bottleneck.HOST,
    PhaseKind.LEAK: Bottleneck.COMPUTE,
    PhaseKind.STRAGGLER: Bottleneck.COMMUNICATION,  # the peers wait; the slow rank computes
}


@pytest.mark.parametrize("kind", list(PhaseKind))
@pytest.mark.parametrize("model", ["h100-sxm", "h200-sxm"])
def test_each_phase_kind_classifies_as_intended(kind: PhaseKind, model: str) -> None:
    """The real classifier, fed what the agent would see: the step's phases and the GPU's
    samples over it. (tests/sim/test_verdicts.py checks the same through a live agent.)"""
    gpu = gpu_model(model)
    timeline = Timeline(one_phase(kind.value, 10), WORLD, gpu.memory_total_bytes, 100.0, False)
    cycle = [c for c in (timeline.cycle(n, 100.0) for n in range(60)) if c is not None][-1]
    source = SimulatedSource(WORLD, gpu, seed=7)
    for rank in range(WORLD):
        source.set_activity(rank, gpu_activity(cycle, rank))
    samples = [source.sample(1000.0 + 0.2 * i, 10.0 + 0.2 * i) for i in range(4)]
    records = []
    for rank in range(WORLD):
        m = cycle.steps[rank].memory
        records.append(StepRecord(
            run="sim", rank=rank, step=1, duration_s=cycle.end(rank) - cycle.starts[rank],
            t_start=1000.1, phases_s=phases_of(cycle, rank), flops=FLOPS_PER_STEP,
            mem=MemoryStats(m["allocated"], m["reserved"], m["peak"], m["retries"], m["ooms"]),
            comm=comm_of(cycle, rank)))
    standings = judge_run({r.rank: RankWork(own_work_s(r), r.phases_s["data"]) for r in records})
    for rank, record in enumerate(records):
        standing = standings[rank]
        window = summarize_gpu_window([s[rank] for s in samples[1:]], 1000.1, 1000.7)
        device = DeviceSpec(peak_flops=resolve_peak_flops(gpu.name),
                            memory_total_bytes=gpu.memory_total_bytes,
                            peak_dram_bytes_per_second=resolve_peak_dram(gpu.name),
                            peak_nvlink_bytes_per_second=resolve_peak_nvlink(gpu.name))
        verdict = classify(StepEvidence(record, window, device=device, standing=standing))
        expected = EXPECTED[kind]
        if kind is PhaseKind.STRAGGLER and rank == SLOW:
            expected = Bottleneck.COMPUTE
        assert verdict.primary is expected, (kind, rank, verdict)
        assert (Flag.STRAGGLER in verdict.flags) == (kind is PhaseKind.STRAGGLER and rank == SLOW)
        assert (Flag.MEMORY_PRESSURE in verdict.flags) == (kind is PhaseKind.LEAK)
        assert verdict.confidence >= 0.5
    if kind is PhaseKind.COMPUTE:
        assert verdict.mfu is not None and 0.45 <= verdict.mfu <= 0.6


def test_a_job_needs_one_gpu_per_rank_and_its_straggler() -> None:
    with pytest.raises(ValueError, match="9 ranks on 8 GPUs"):
        check_job(one_phase("compute"), 9, 8)
    with pytest.raises(ValueError, match="phase 1: straggler rank 4, but the job has ranks 0-3"):
        check_job(one_phase("straggler", extra="rank = 4"), 4, 8)
    check_job(one_phase("straggler", extra="rank = 3"), 4, 8)
    # A node's share of a run spread over several nodes.
    check_job(one_phase("straggler", extra="rank = 5"), 2, 2, rank_offset=4, world=6)
    with pytest.raises(ValueError, match="ranks 4-5 on this node, but the run has ranks 0-4"):
        check_job(one_phase("compute"), 2, 2, rank_offset=4, world=5)
    with pytest.raises(ValueError, match="straggler rank 6, but the job has ranks 0-5"):
        check_job(one_phase("straggler", extra="rank = 6"), 2, 2, rank_offset=4, world=6)


@pytest.fixture
def receiver_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gpumon") as short:
        yield Path(short) / "r.sock"


def run_and_receive(job: SimulatedJob, path: Path) -> list[object]:
    """Run ``job`` to its end, receiving what its ranks send to ``path`` as the agent does (a
    thread that only reads: the socket's queue holds few datagrams); every record, once the
    job has stopped (its monitors flushed on close) and the socket is empty."""
    records: list[object] = []
    job_done = threading.Event()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(0.1)

        def receive() -> None:
            while True:
                try:
                    records.extend(decode_datagram(sock.recv(1 << 16)).records)
                except TimeoutError:
                    if job_done.is_set():
                        return

        reader = threading.Thread(target=receive)
        reader.start()
        job.start()
        try:
            assert job.wait(10)
        finally:
            job.stop()
            job_done.set()
            reader.join()
    return records


def test_ranks_report_through_the_real_hook_and_socket(receiver_path: Path) -> None:
    source = SimulatedSource(3, H200_SXM)
    uuids = [g.uuid for g in source.statics()]
    job = SimulatedJob(source, one_phase("leak", 2), ranks=2, socket_path=str(receiver_path),
                       run="t", loop=False)
    records = run_and_receive(job, receiver_path)
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert {(s.rank, s.gpu, s.world, s.local_rank) for s in steps} == {
        (0, uuids[0], 2, 0), (1, uuids[1], 2, 1)}
    for rank in (0, 1):
        mine = sorted((s for s in steps if s.rank == rank), key=lambda s: s.step)
        assert len(mine) >= 5
        assert set(mine[0].phases_s) == {"data", "forward", "backward", "optimizer"}
        assert all(s.comm is not None and s.comm.ops[0].name == "all_reduce"
                   and s.comm.ops[0].bytes == GRADIENT_BYTES for s in mine)
        assert all(s.flops == FLOPS_PER_STEP and s.tokens == 16384 for s in mine)
        peaks = [s.mem.peak_bytes for s in mine if s.mem is not None]
        assert len(peaks) == len(mine) and peaks[-1] > peaks[0]
        assert 0.15 < min(s.duration_s for s in mine[1:])
    # The ranks are gone and their GPUs idle; the unused third GPU was idle all along.
    assert all(source.activity(i, time.time()).utilization == 0.0 for i in range(3))


def test_a_node_of_a_multi_node_run_reports_its_ranks_and_waits_for_the_others(
        receiver_path: Path) -> None:
    """Ranks 2-3 of a 6-rank run on this node's GPUs 0-1; the straggler, rank 5, is on
    another node, and these ranks still wait for it in the all-reduce."""
    source = SimulatedSource(2)
    uuids = [g.uuid for g in source.statics()]
    job = SimulatedJob(source, one_phase("straggler", 2, "rank = 5"), ranks=2,
                       socket_path=str(receiver_path), run="t", loop=False, rank_offset=2,
                       world=6)
    records = run_and_receive(job, receiver_path)
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert {(s.rank, s.gpu, s.world, s.local_rank) for s in steps} == {
        (2, uuids[0], 6, 0), (3, uuids[1], 6, 1)}
    healthy = cycles(one_phase("compute"), 1)[0].steps[0]
    straggler_extra_s = 0.6 * (healthy.forward_s + healthy.backward_s)  # slowdown 1.6
    assert len(steps) >= 6
    for step in steps:
        assert step.comm is not None
        assert step.comm.exposed_s > 0.8 * straggler_extra_s, step.comm
