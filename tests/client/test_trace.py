"""A rank's trace channel (``gpumon.client.trace_control``) asked directly, as the agent asks it: a hooked
CPU loop profiled for K whole steps without a change to its losses, two requests at once giving
one trace, and what a request gets from a process without torch, from a profiler that raises
and from a disk that takes no more (the file-size limit of the job's process): an answer that
names the reason, and a job that goes on to its last step. The agent's side is this test: it
binds the ingest socket the monitor sends to (so it is the socket's owner, whom the rank
trusts) and asks from a socket of its own."""

from __future__ import annotations

import gzip
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpumon.client import StepMonitor
from gpumon.wire.traces import channel_address
from tests.helpers import ROOT


class FakeAgent:
    """The agent's two sockets: the ingest socket (read and thrown away) and the desk's."""

    def __init__(self, directory: Path) -> None:
        self.socket_path = str(directory / "ingest.sock")
        self.ingest = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.ingest.bind(self.socket_path)
        self.ingest.setblocking(False)
        self.desk = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.desk.bind(b"")
        self.desk.settimeout(0.1)
        self.traces = directory / "traces"
        self.traces.mkdir()

    def ask(self, run: str, rank: int, ident: str, steps: int = 3) -> None:
        message = {"op": "trace", "id": ident, "steps": steps, "dir": str(self.traces)}
        self.desk.sendto(json.dumps(message).encode(), channel_address(self.socket_path, run, rank))

    def answers(self, until: str, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Answers until one in state ``until`` (or a final one) came, or ``timeout``."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._drain_ingest()
            try:
                out.append(json.loads(self.desk.recv(4096)))
            except TimeoutError:
                continue
            if out[-1]["state"] in (until, "done", "error"):
                break
        return out

    def _drain_ingest(self) -> None:
        try:
            while self.ingest.recv(65536):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self.ingest.close()
        self.desk.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[FakeAgent]:
    fake = FakeAgent(tmp_path)
    yield fake
    fake.close()


def train(monitor: StepMonitor, steps: int, ask: Any = None) -> list[float]:
    """A deterministic loop hooked by hand; ``ask()`` is called before step 5."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        if i == 5 and ask is not None:
            ask()
        x = torch.randn(16, 32, generator=generator)
        with monitor.step():
            with monitor.phase("forward"):
                loss = model(x).square().mean()
            with monitor.phase("backward"):
                loss.backward()
            with monitor.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
        losses.append(loss.item())
        time.sleep(0.004)
    return losses


def test_a_trace_of_three_whole_steps_leaves_the_losses_as_they_were(agent: FakeAgent) -> None:
    plain = StepMonitor("plain", socket_path=agent.socket_path, rank=0, world=1)
    without = train(plain, 120)
    plain.close()
    traced = StepMonitor("traced", socket_path=agent.socket_path, rank=3, world=4, local_rank=3)
    with_trace = train(traced, 120, ask=lambda: agent.ask("traced", 3, "t1"))
    answers = agent.answers("done")
    traced.close()

    assert with_trace == without
    assert [a["state"] for a in answers] == ["accepted", "done"], answers
    done = answers[-1]
    path = Path(done["path"])
    assert path.parent == agent.traces
    assert path.name == f"traced.rank3.step{done['first_step']}.pt.trace.json.gz"
    assert (path.stat().st_mode & 0o777) == 0o600 and done["steps"] == 3
    with gzip.open(path) as f:
        document = json.load(f)
    names = [e["name"] for e in document["traceEvents"] if e.get("ph") == "X"]
    first = done["first_step"]
    steps = [n for n in names if n.startswith("gpumon.step ")]
    assert steps == [f"gpumon.step {s}" for s in range(first, first + 3)]
    for phase in ("forward", "backward", "optimizer"):
        assert names.count(f"gpumon.{phase}") == 3
    assert names.count("gpumon.record") == 3
    # Each phase's range is drawn from the readings the core timed the phase from: its length
    # is the phase's seconds in the step's record, to the trace's nanosecond rounding.
    events = [e for e in document["traceEvents"] if e.get("ph") == "X"]
    for record in (e for e in events if e["name"] == "gpumon.record"):
        ranges: dict[str, float] = {}
        for e in events:
            if e.get("cat") == "gpumon" and e["name"] != "gpumon.record" \
                    and "phase" in e.get("args", {}) \
                    and record["ts"] <= e["ts"] + e["dur"] / 2 < record["ts"] + record["dur"]:
                ranges[e["args"]["phase"]] = ranges.get(e["args"]["phase"], 0.0) + e["dur"] / 1e6
        assert set(ranges) == {"forward", "backward", "optimizer"}, (record, [
            (e["name"], e["ts"], e["dur"]) for e in events if e.get("cat") == "gpumon"])
        for phase, seconds in ranges.items():
            assert seconds == pytest.approx(record["args"]["phases"][phase], abs=2e-9), (
                phase, record, [(e["name"], e["ts"], e["dur"]) for e in events
                                if e.get("cat") == "gpumon"])
    assert document["distributedInfo"] == {"rank": 3, "world_size": 4}
    assert traced.stats.extension_errors == 0


def test_two_requests_at_once_give_one_trace(agent: FakeAgent) -> None:
    monitor = StepMonitor("twice", socket_path=agent.socket_path, rank=0, world=1)

    def ask_twice() -> None:
        agent.ask("twice", 0, "first")
        agent.ask("twice", 0, "second")

    train(monitor, 80, ask=ask_twice)
    answers = agent.answers("done")
    monitor.close()
    states = [(a["id"], a["state"]) for a in answers]
    assert states[:2] == [("first", "accepted"), ("second", "busy")], states
    assert answers[1]["trace"] == "first" and states[-1] == ("first", "done")
    assert len(list(agent.traces.glob("*.gz"))) == 1


def test_a_profiler_that_raises_ends_the_trace_and_never_the_job(
        agent: FakeAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler is replaced by one whose ``start`` raises: a failure torch's own cannot be
    made to have on demand."""
    import torch.profiler

    class Broken:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def start(self) -> None:
            raise RuntimeError("profiler already running")

    monkeypatch.setattr(torch.profiler, "profile", Broken)
    monitor = StepMonitor("broken", socket_path=agent.socket_path, rank=0, world=1)
    losses = train(monitor, 60, ask=lambda: agent.ask("broken", 0, "b"))
    answers = agent.answers("error")
    stats = monitor.stats
    monitor.close()
    assert len(losses) == 60 and stats.steps == 60 and stats.extension_errors == 0
    assert answers[-1]["state"] == "error" and answers[-1]["reason"] == "profiler_error"
    assert "profiler already running" in answers[-1]["message"]


LOOP = """
import sys, time
from gpumon.client import StepMonitor
if sys.argv[2] == "torch":
    import torch
mon = StepMonitor("job", socket_path=sys.argv[1], rank=0, world=1)
print("ready", flush=True)
for i in range(int(sys.argv[3])):
    with mon.step():
        with mon.phase("forward"):
            if sys.argv[2] == "torch":
                torch.ones(64, 64).matmul(torch.ones(64, 64))
            time.sleep(0.005)
print("steps", mon.stats.steps, flush=True)
"""


def run_job(agent: FakeAgent, kind: str, steps: int,
            file_size: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    def limit() -> None:
        if file_size is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    job = subprocess.Popen([sys.executable, "-c", LOOP, agent.socket_path, kind, str(steps)],
                           stdout=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=limit,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert job.stdout is not None and job.stdout.readline() == "ready\n"
    agent.ask("job", 0, "j")
    answers = agent.answers("error")
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 0, out
    return out, answers


def test_a_process_without_torch_says_so(agent: FakeAgent) -> None:
    out, answers = run_job(agent, "plain", 200)
    assert "steps 200" in out
    assert answers[-1]["state"] == "error" and answers[-1]["reason"] == "no_torch", answers


def test_a_full_disk_is_an_answer_and_the_job_goes_on(agent: FakeAgent) -> None:
    """The job's file-size limit (4 KiB) stands for a disk that takes no more: the kernel refuses
    the write as it would on a full one (EFBIG, beside ENOSPC and EDQUOT)."""
    out, answers = run_job(agent, "torch", 200, file_size=4096)
    assert "steps 200" in out
    assert answers[-1]["state"] == "error" and answers[-1]["reason"] == "no_space", answers
    assert list(agent.traces.iterdir()) == []  # nothing half-written is left


ENDING = """
import sys, time, torch
from gpumon.client import StepMonitor
mon = StepMonitor("job", socket_path=sys.argv[1], rank=0, world=1)
print("ready", flush=True)
tracer = None
while tracer is None or tracer._prof is None:  # until the profiler runs
    with mon.step():
        torch.ones(64, 64).matmul(torch.ones(64, 64))
        time.sleep(0.005)
    tracer = mon._trace._tracer
print("profiling at step", mon.stats.steps, flush=True)
"""


def test_a_process_that_ends_mid_trace_exits_cleanly_and_says_so(agent: FakeAgent) -> None:
    """A job whose last step comes while a trace is under way: a profiler left running when
    the interpreter exits crashes the process (SIGSEGV). Its monitor's close at exit stops it,
    and the agent hears why the trace never came."""
    job = subprocess.Popen([sys.executable, "-c", ENDING, agent.socket_path], stdout=subprocess.PIPE,
                           text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert job.stdout is not None and job.stdout.readline() == "ready\n"
    agent.ask("job", 0, "e", steps=20)
    answers = agent.answers("error")
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 0, out
    assert "profiling at step" in out
    assert [a["state"] for a in answers] == ["accepted", "error"], answers
    assert answers[-1]["reason"] == "ended", answers
    assert list(agent.traces.iterdir()) == []
