"""Runs that stop, for real: DDP jobs on gloo under ``torch.distributed.run`` whose ranks block
in their data pipeline, deadlock in forward, skip an all-reduce, hold the interpreter's lock or
are killed, against a real agent; what the agent's metrics, ``gpumon stacks`` and the snapshot
say about each rank, against what the job itself wrote when it stopped.

The hooks' stall floor is set to 1 s (``GPUMON_STALL_AFTER_S``) so that each case takes
seconds: the rule is otherwise the same (10 typical steps, here of ~0.1 s), and its defaults
are held to the minute the runbook promises by the client's unit tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumon.testing import AgentProcess, free_port
from gpumon.testing.metrics import series
from gpumon.testing.processes import kill_tree
from tests.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.agent("--interval", "0.5")]

JOB = Path(__file__).resolve().parent / "jobs" / "hang_job.py"
STALL_FLOOR_S = "1"
DETECT_WITHIN_S = 60.0
EXIT_SEEN_WITHIN_S = 30.0


class RunningJob:
    """A ``torch.distributed.run`` job left running (it will not end by itself), killed at the end."""

    def __init__(self, agent: AgentProcess, tmp_path: Path, run: str, nproc: int, *args: str) -> None:
        self.out = tmp_path / run
        self.run = run
        env = {**os.environ, "GPUMON_SOCKET": str(agent.socket_path), "GPUMON_RUN": run,
               "GPUMON_STALL_AFTER_S": STALL_FLOOR_S, "PYTHONPATH": str(ROOT),
               "OMP_NUM_THREADS": "1"}
        env.pop("GPUMON_PURE_PYTHON", None)
        self.log = (tmp_path / f"{run}.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--master-port", str(free_port()), str(JOB), "--out", str(self.out), *args],
            env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def note(self, rank: int) -> dict[str, Any]:
        """What rank ``rank`` last wrote about itself (``{}`` before its first step)."""
        path = self.out / f"rank{rank}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def wait_note(self, rank: int, what: str, timeout_s: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            note = self.note(rank)
            if note.get("what") == what:
                return note
            assert self.process.poll() is None, f"the job ended early:\n{self.output()}"
            time.sleep(0.2)
        raise AssertionError(f"rank {rank} never reached {what!r}:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        kill_tree(self.process.pid)  # torchrun's workers run in sessions of their own
        self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture
def jobs() -> Iterator[list[RunningJob]]:
    started: list[RunningJob] = []
    yield started
    for job in started:
        job.stop()


def conditions(agent: AgentProcess, run: str) -> dict[int, dict[str, Any]]:
    """rank -> {state, info labels, stalled seconds, steps} from one scrape."""
    metrics = agent.metrics()
    out: dict[int, dict[str, Any]] = {}
    for labels, v in series(metrics, "gpumon_rank_state", run=run):
        if v == 1.0:
            out.setdefault(int(labels["rank"]), {})["state"] = labels["state"]
    for labels, _ in series(metrics, "gpumon_rank_stall_info", run=run):
        out.setdefault(int(labels["rank"]), {})["info"] = labels
    for labels, v in series(metrics, "gpumon_rank_stalled_seconds", run=run):
        out.setdefault(int(labels["rank"]), {})["stalled_s"] = v
    for labels, v in series(metrics, "gpumon_steps_total", run=run):
        out.setdefault(int(labels["rank"]), {})["steps"] = v
    return out


def wait_conditions(agent: AgentProcess, run: str, want: dict[int, str], timeout_s: float,
                    job: RunningJob) -> tuple[dict[int, dict[str, Any]], float]:
    """The first scrape where each rank of ``want`` is in its state, and when it came."""
    deadline = time.monotonic() + timeout_s
    seen: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        seen = conditions(agent, run)
        if all(seen.get(rank, {}).get("state") == state for rank, state in want.items()):
            return seen, time.time()
        time.sleep(0.5)
    raise AssertionError(f"not {want} within {timeout_s:.0f} s: {seen}\n{job.output()}")


def stacks(agent: AgentProcess, run: str, *extra: str) -> str:
    done = subprocess.run([sys.executable, "-m", "gpumon.cli", "stacks", "--url", agent.url,
                           "--run", run, *extra], capture_output=True, text=True, timeout=30,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_rank_blocked_in_its_data_pipeline_and_the_rank_waiting_for_it(
        agent: AgentProcess, tmp_path: Path, jobs: list[RunningJob]) -> None:
    job = RunningJob(agent, tmp_path, "stuck-data", 2, "--scenario", "data", "--rank", "1",
                     "--stop-after", "15")
    jobs.append(job)
    stopped = job.wait_note(1, "data")
    seen, at = wait_conditions(agent, job.run, {0: "stalled", 1: "stalled"}, DETECT_WITHIN_S, job)
    assert at - stopped["t"] < DETECT_WITHIN_S
    blocked, waiting = seen[1]["info"], seen[0]["info"]
    assert blocked["phase"] == "data" and blocked["op"] == "" and blocked["waits_on"] == ""
    assert blocked["location"].startswith("hang_job.py:")
    assert blocked["location"].endswith(" Shards.read_shard")
    assert waiting["op"] == "all_reduce" and waiting["waits_on"] == "1"
    assert waiting["phase"] == "backward"
    # every step before the stall was counted: 15 on each rank (rank 0 hangs in its 16th)
    assert seen[1]["steps"] == 15 and seen[0]["steps"] == 15
    assert job.note(0)["steps"] == 15
    assert seen[0]["stalled_s"] > 0 and seen[1]["stalled_s"] > 0

    text = stacks(agent, job.run)
    assert "rank 0" in text and "rank 1" in text
    assert "in collective: all_reduce #" in text and "waits on: rank(s) 1" in text
    assert "Shards.read_shard" in text and "threading.py" in text
    document = json.loads(stacks(agent, job.run, "--json"))
    ranks = {r["rank"]: r for r in document["runs"][job.run]}
    own = [f["function"] for f in ranks[1]["stack"] if f["own"]]
    assert own[:2] == ["Shards.read_shard", "Shards.__iter__"] and "main" in own
    assert ranks[0]["collective"]["op"] == "all_reduce" and ranks[0]["waits_on"] == [1]

    os.kill(stopped["pid"], signal.SIGKILL)
    killed = time.time()
    seen, at = wait_conditions(agent, job.run, {1: "exited"}, EXIT_SEEN_WITHIN_S, job)
    assert at - killed < EXIT_SEEN_WITHIN_S
    assert seen[1]["steps"] == 15  # kept until it expires


def test_a_rank_deadlocked_in_forward_is_what_three_ranks_wait_on(
        agent: AgentProcess, tmp_path: Path, jobs: list[RunningJob]) -> None:
    job = RunningJob(agent, tmp_path, "stuck-lock", 4, "--scenario", "lock", "--rank", "2",
                     "--stop-after", "12")
    jobs.append(job)
    stopped = job.wait_note(2, "lock")
    want = dict.fromkeys(range(4), "stalled")
    seen, at = wait_conditions(agent, job.run, want, DETECT_WITHIN_S, job)
    assert at - stopped["t"] < DETECT_WITHIN_S
    culprit = seen[2]["info"]
    assert culprit["phase"] == "forward" and culprit["op"] == ""
    assert culprit["location"].endswith(" Adapted.apply_adapter")
    for rank in (0, 1, 3):
        info = seen[rank]["info"]
        assert (info["op"], info["waits_on"], info["phase"]) == ("all_reduce", "2", "backward"), info


def test_a_rank_that_skipped_an_all_reduce_is_behind_its_peers(
        agent: AgentProcess, tmp_path: Path, jobs: list[RunningJob]) -> None:
    # Rank 1 runs one step under no_sync(); gloo pairs its later all-reduces with its peer's
    # earlier ones, so the run goes on until rank 0's last all-reduce finds no partner.
    job = RunningJob(agent, tmp_path, "skipped", 2, "--scenario", "skip", "--rank", "1",
                     "--stop-after", "5", "--steps", "20")
    jobs.append(job)
    stopped = job.wait_note(1, "skip")
    seen, at = wait_conditions(agent, job.run, {0: "stalled", 1: "stalled"}, DETECT_WITHIN_S, job)
    assert at - stopped["t"] < DETECT_WITHIN_S
    assert seen[0]["info"]["op"] == "all_reduce" and seen[0]["info"]["waits_on"] == "1"
    assert seen[1]["info"]["location"].endswith(" upload_checkpoint")
    ranks = {r["rank"]: r for r in json.loads(stacks(agent, job.run, "--json"))["runs"][job.run]}
    # Rank 0 waits in all-reduce number N; rank 1 launched one fewer (one bucket a step).
    waiting_seq = ranks[0]["collective"]["seq"]
    assert ranks[1]["collective"] is None
    assert ranks[1]["collectives_launched"] == waiting_seq - 1
    assert seen[0]["steps"] == 19 and seen[1]["steps"] == 20


def test_a_rank_holding_the_interpreter_lock_is_stalled_with_its_place_unknown(
        agent: AgentProcess, tmp_path: Path, jobs: list[RunningJob]) -> None:
    job = RunningJob(agent, tmp_path, "gil-held", 2, "--scenario", "gil", "--rank", "1",
                     "--stop-after", "10")
    jobs.append(job)
    stopped = job.wait_note(1, "gil")
    seen, at = wait_conditions(agent, job.run, {0: "stalled", 1: "stalled"}, DETECT_WITHIN_S, job)
    assert at - stopped["t"] < DETECT_WITHIN_S
    silent = seen[1]["info"]
    assert silent["phase"] == "unknown" and silent["location"].startswith("unknown: the process lives")
    assert seen[0]["info"]["waits_on"] == "1"


def test_one_slow_step_of_a_healthy_run_is_never_a_stall(
        agent: AgentProcess, tmp_path: Path, jobs: list[RunningJob]) -> None:
    # Steps of ~0.15 s, one of them 0.5 s longer (a checkpoint save, about 4 typical steps):
    # below the threshold of 10 typical steps even as the watch sees steps at 0.25 s ticks.
    job = RunningJob(agent, tmp_path, "healthy", 2, "--scenario", "slow", "--stop-after", "30",
                     "--steps", "60", "--work-ms", "100", "--slow-ms", "500")
    jobs.append(job)
    states: set[str] = set()
    deadline = time.monotonic() + 90
    # Until a rank finished its steps (then its monitor closes and it is finished).
    while max(job.note(0).get("steps", 0), job.note(1).get("steps", 0)) < 60:
        assert job.process.poll() is None and time.monotonic() < deadline, job.output()
        states |= {c.get("state", "") for c in conditions(agent, job.run).values()}
        time.sleep(0.25)
    assert states == {"stepping"}
    assert job.process.wait(timeout=60) == 0, job.output()
    # A clean end is finished, never exited (what GpumonRankExited fires on).
    wait_conditions(agent, job.run, {0: "finished", 1: "finished"}, EXIT_SEEN_WITHIN_S, job)
