"""End to end: the short schedule through a live agent; what /metrics exports per phase.

The simulated job reports through the real hook and socket, the agent samples the simulated
GPUs and classifies every step as it would on a real node. The exported current verdict of
each rank is scraped four times a second; for each phase its majority over the phase (after
the agent's lag, before the next phase shows) must be the phase's bottleneck.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpumon.agent.config import AgentConfig
from gpumon.agent.lifecycle import Agent
from gpumon.sim.gpus import SimulatedSource
from gpumon.sim.job import SimulatedJob
from gpumon.sim.schedule import PhaseKind, load_schedule
from tests.helpers import http_get, parse_metrics

pytestmark = pytest.mark.waits

RANKS = 4
SLOW = RANKS - 1  # the short schedule's straggler: the last rank
INTERVAL_S = 0.25
SETTLE_S = 2.5  # a phase's steps show after the analysis lag (interval + 0.5 s) and a cycle
OVERHANG_S = 0.7  # ... and the previous phase's last steps still show that long after it

EXPECTED = {
    PhaseKind.COMPUTE: "compute",
    PhaseKind.INPUT: "input",
    PhaseKind.COMMUNICATION: "communication",
    PhaseKind.MEMORY_BANDWIDTH: "memory_bandwidth",
    PhaseKind.HOST: "host",
    PhaseKind.LEAK: "compute",  # it computes while it leaks: the flag and OOM risk tell
    PhaseKind.STRAGGLER: "communication",  # the peers wait; the slow rank itself computes
}


@dataclass
class Observation:
    t: float  # seconds since the job started
    verdicts: dict[int, str] = field(default_factory=dict)
    flags: dict[int, set[str]] = field(default_factory=dict)
    risk: dict[int, float] = field(default_factory=dict)
    predicted_s: dict[int, float] = field(default_factory=dict)
    peak_bytes: dict[int, float] = field(default_factory=dict)
    causes: dict[int, str] = field(default_factory=dict)
    exposed_s: dict[int, float] = field(default_factory=dict)


def observe(metrics_text: str, t: float) -> Observation:
    seen = Observation(t)
    for (name, labels), value in parse_metrics(metrics_text).items():
        tags = dict(labels)
        if tags.get("run") != "sim":
            continue
        rank = int(tags["rank"])
        if name == "gpumon_step_bottleneck_current" and value == 1:
            seen.verdicts[rank] = tags["bottleneck"]
        elif name == "gpumon_step_flag" and value == 1:
            seen.flags.setdefault(rank, set()).add(tags["flag"])
        elif name == "gpumon_oom_risk_ratio":
            seen.risk[rank] = value
        elif name == "gpumon_oom_predicted_seconds":
            seen.predicted_s[rank] = value
        elif name == "gpumon_torch_memory_peak_bytes":
            seen.peak_bytes[rank] = value
        elif name == "gpumon_rank_straggler_cause" and value == 1:
            seen.causes[rank] = tags["cause"]
        elif name == "gpumon_comm_exposed_seconds_total":
            seen.exposed_s[rank] = value
    return seen


@pytest.fixture(scope="module")
def observations(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Observation]]:
    """Run the short schedule once through a live agent, scraping as it goes."""
    tmp = Path(tmp_path_factory.mktemp("verdicts"))
    source = SimulatedSource(RANKS)
    agent = Agent(AgentConfig(address="127.0.0.1", port=0, simulate=RANKS, interval=INTERVAL_S,
                              socket=str(tmp / "s.sock")), gpu_source=source)
    agent.start()
    job = SimulatedJob(source, load_schedule("short"), ranks=RANKS,
                       socket_path=agent.config.socket, run="sim", loop=False)
    seen: list[Observation] = []
    try:
        job.start()
        started = time.monotonic()
        end = started + job.schedule.seconds + 3.0
        while time.monotonic() < end:
            status, body = http_get(f"http://127.0.0.1:{agent.port}/metrics")
            assert status == 200
            seen.append(observe(body.decode(), time.monotonic() - started))
            time.sleep(INTERVAL_S)
        assert job.wait(5)
    finally:
        job.stop()
        agent.stop()
    yield seen


def phase_windows() -> Iterator[tuple[PhaseKind, float, float]]:
    start = 0.0
    for phase in load_schedule("short").phases:
        yield phase.kind, start, start + phase.seconds
        start += phase.seconds


def majority(observations: list[Observation], rank: int, t0: float, t1: float) -> tuple[str, float]:
    votes = Counter(o.verdicts[rank] for o in observations if t0 <= o.t <= t1 and rank in o.verdicts)
    assert votes, f"no verdict for rank {rank} between {t0} and {t1} s"
    verdict, count = votes.most_common(1)[0]
    return verdict, count / sum(votes.values())


@pytest.mark.parametrize("kind", list(PhaseKind))
def test_the_exported_verdict_follows_the_phase(observations: list[Observation],
                                                kind: PhaseKind) -> None:
    _, start, end = next(w for w in phase_windows() if w[0] is kind)
    t0, t1 = start + SETTLE_S, end + OVERHANG_S
    results = {rank: majority(observations, rank, t0, t1) for rank in range(RANKS)}
    print(f"{kind.value}: " + ", ".join(f"rank {r} {v} {share:.0%}"
                                        for r, (v, share) in results.items()))
    for rank, (verdict, share) in results.items():
        expected = EXPECTED[kind]
        if kind is PhaseKind.STRAGGLER and rank == SLOW:
            expected = "compute"
        assert verdict == expected, (kind, rank, results)
        assert share >= 0.6, (kind, rank, results)


def test_the_straggler_is_flagged_and_its_peers_are_not(observations: list[Observation]) -> None:
    _, start, end = next(w for w in phase_windows() if w[0] is PhaseKind.STRAGGLER)
    during = [o for o in observations if start <= o.t <= end + 2.0]
    flagged = Counter(r for o in during for r, flags in o.flags.items() if "straggler" in flags)
    assert flagged[SLOW] >= 3, flagged
    assert set(flagged) == {SLOW}, flagged
    assert {r: c for o in during for r, c in o.causes.items()} == {SLOW: "compute"}
    before = [o for o in observations if o.t < start]
    assert not any("straggler" in f for o in before for f in o.flags.values())


def test_the_job_reports_its_collectives_through_the_comm_field(
        observations: list[Observation]) -> None:
    """No rank times a comm phase: what the agent counts as time blocked on collectives came
    in the records' measured comm field, as from a watched DDP job; during the straggler
    phase the peers' wait grows, the straggler's does not."""
    _, start, end = next(w for w in phase_windows() if w[0] is PhaseKind.STRAGGLER)
    first = next(o for o in observations if o.t >= start + SETTLE_S and len(o.exposed_s) == RANKS)
    last = [o for o in observations if o.t <= end and len(o.exposed_s) == RANKS][-1]
    waited = {r: last.exposed_s[r] - first.exposed_s[r] for r in range(RANKS)}
    assert all(waited[r] > 5 * waited[SLOW] for r in range(RANKS) if r != SLOW), waited


def test_the_leak_warns_before_memory_runs_out(observations: list[Observation]) -> None:
    _, start, end = next(w for w in phase_windows() if w[0] is PhaseKind.LEAK)
    capacity = SimulatedSource(1).model.memory_total_bytes
    before = [o for o in observations if o.t < start + 1.0]
    assert not any(o.predicted_s for o in before), "an OOM predicted before the leak began"
    assert not any("memory_pressure" in f for o in before for f in o.flags.values())
    during = [o for o in observations if start <= o.t <= end + 2.0]
    for rank in range(RANKS):
        warned = [o for o in during if rank in o.predicted_s]
        assert warned, f"rank {rank}: no OOM prediction during the leak"
        # Warned while there was room left, with a time to act on, and counting down.
        early = [o for o in warned if o.peak_bytes[rank] < 0.9 * capacity]
        assert early, f"rank {rank}: warned only once memory was already under pressure"
        assert min(o.predicted_s[rank] for o in early) < 30
        assert warned[-1].predicted_s[rank] < warned[0].predicted_s[rank]
        assert any(o.risk.get(rank, 0) >= 0.8 for o in during)
        assert any("memory_pressure" in o.flags.get(rank, set()) for o in during)
