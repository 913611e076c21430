"""The simulated multi-node run: records as synchronous data parallelism makes them, each
rank to its node's agent, the straggler visible only across nodes."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from gpumon.sim.fleet import FleetRun, FleetSender
from gpumon.testing import library_agent, scrape_metrics, series, wait_for


def test_every_rank_waits_for_the_straggler_and_steps_last_alike() -> None:
    run = FleetRun("r", nodes=3, ranks_per_node=2, straggler=5, slowdown=1.5)
    assert run.world == 6 and list(run.ranks_of(2)) == [4, 5]
    records = [run.record(rank, 7, 100.0, None) for rank in range(run.world)]
    assert all(r["duration"] == pytest.approx(0.8 * 1.5 + 0.1) for r in records)
    exposed = {r["rank"]: r["comm"]["exposed"] for r in records}  # type: ignore[index]
    assert exposed[5] == pytest.approx(0.1)  # the straggler waits for nobody
    assert all(exposed[r] == pytest.approx(0.5) for r in range(5))
    for record in records:
        phases = record["phases"]
        assert sum(phases.values()) == pytest.approx(record["duration"])  # type: ignore[attr-defined]
        assert record["local_rank"] == record["rank"] % 2  # type: ignore[operator]
    assert "memb" not in records[0] and "memb" in run.record(0, 10, 1.0, None)


def test_bad_runs_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="straggler rank 4"):
        FleetRun("r", nodes=2, ranks_per_node=2, straggler=4)
    with pytest.raises(ValueError, match="at least one node"):
        FleetRun("r", nodes=0, ranks_per_node=2)
    with pytest.raises(ValueError, match="2 nodes need 2 sockets"):
        FleetSender(FleetRun("r", nodes=2, ranks_per_node=1), ["a"])


def test_each_node_reports_its_own_ranks_to_its_own_agent(tmp_path: Path) -> None:
    run = FleetRun("spread", nodes=2, ranks_per_node=2, compute_s=0.08, data_s=0.01,
                   allreduce_s=0.02, straggler=3)
    with library_agent(tmp_path / "a.sock", simulate=2) as a, \
            library_agent(tmp_path / "b.sock", simulate=2) as b:
        sender = FleetSender(run, [a.config.socket, b.config.socket])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        t0 = time.time() - 5 * run.step_s
        for step in range(5):
            sender.send_step(step, t0 + (step + 1) * run.step_s, sock)
        sock.close()

        def ranks(agent: object) -> set[str]:
            steps = series(scrape_metrics(agent), "gpumon_steps_total", run="spread")
            return {labels["rank"] for labels, value in steps if value == 5}

        assert wait_for(lambda: ranks(a) == {"0", "1"}, timeout=10)
        assert wait_for(lambda: ranks(b) == {"2", "3"}, timeout=10)
    assert sender.sent == 20 and sender.failed == 0
