"""The real hook in a real PyTorch (CPU) training loop, reporting to a real agent."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpumon.client import StepMonitor
from gpumon.client.core.transport import UnixDatagramTransport
from gpumon.wire import StepRecord, decode_datagram
from tests.helpers import AgentProcess, start_agent, value, values, wait_for

BATCH = 16
SEQ = 8


class TeeTransport(UnixDatagramTransport):
    """The real socket transport, keeping a copy of every datagram it managed to send."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.sent: list[bytes] = []

    def send(self, datagram: bytes) -> str | None:
        failure = super().send(datagram)
        if failure is None:
            self.sent.append(datagram)
        return failure

    def steps(self) -> list[StepRecord]:
        return [r for d in self.sent for r in decode_datagram(d).records
                if isinstance(r, StepRecord)]


def train(mon: StepMonitor, steps: int, stop: threading.Event | None = None,
          step_times: list[float] | None = None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(BATCH * 8, 32), torch.randint(0, 4, (BATCH * 8,)))
    done = 0
    while done < steps and not (stop and stop.is_set()):
        for x, y in mon.loader(DataLoader(data, batch_size=BATCH)):
            started = time.perf_counter()
            with mon.step(samples=len(x), tokens=len(x) * SEQ):
                with mon.phase("forward"):
                    loss = nn.functional.cross_entropy(model(x), y)
                with mon.phase("backward"):
                    loss.backward()
                with mon.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
                with mon.phase("checkpoint_probe"):  # a free-form phase: counted as "other"
                    pass
            if step_times is not None:
                step_times.append(time.perf_counter() - started)
            done += 1
            if done >= steps or (stop and stop.is_set()):
                break


pytestmark = pytest.mark.agent("--simulate", "1", "--interval", "0.5")


def test_agent_counts_exactly_what_the_torch_loop_sent(agent: AgentProcess) -> None:
    tee = TeeTransport(str(agent.socket_path))
    mon = StepMonitor(run="torch-cpu", transport=tee, rank=0, world=1)
    train(mon, steps=60)
    mon.close()
    sent = tee.steps()
    assert len(sent) == 60 and mon.stats.dropped == {}
    m = wait_for(lambda: (lambda m: values(m, "gpumon_steps_total", run="torch-cpu") == [60.0]
                          and m)(agent.metrics()), what="all 60 steps counted")
    labels = {"run": "torch-cpu", "rank": "0"}
    assert value(m, "gpumon_samples_total", **labels) == sum(s.samples for s in sent) == 60 * BATCH
    assert value(m, "gpumon_tokens_total", **labels) == sum(s.tokens for s in sent)
    phases: Counter[str] = Counter()
    for s in sent:
        for name, seconds in s.phases_s.items():
            phases[name if name in ("data", "forward", "backward", "optimizer") else "other"] += seconds
    assert set(phases) == {"data", "forward", "backward", "optimizer", "other"}
    for phase, seconds in phases.items():
        assert value(m, "gpumon_step_phase_seconds_total", phase=phase, **labels) == \
            pytest.approx(seconds, rel=1e-9, abs=1e-12), phase
    assert value(m, "gpumon_step_duration_seconds_sum", **labels) == \
        pytest.approx(sum(s.duration_s for s in sent), rel=1e-9)


def test_agent_killed_and_restarted_mid_training(agent: AgentProcess, tmp_path: Path) -> None:
    mon = StepMonitor(run="restart", socket_path=str(agent.socket_path), rank=0, world=1)
    stop = threading.Event()
    step_times: list[float] = []
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            train(mon, steps=10**9, stop=stop, step_times=step_times)
        except BaseException as exc:  # the loop must never see gpumon's troubles
            errors.append(exc)

    trainer = threading.Thread(target=loop)
    trainer.start()
    try:
        wait_for(lambda: values(agent.metrics(), "gpumon_steps_total", run="restart"),
                 what="steps before the crash")
        agent.stop(signal.SIGKILL)  # a crash: the socket file stays behind, nobody reads it
        assert agent.socket_path.exists()
        before = len(step_times)
        wait_for(lambda: len(step_times) > before + 50, what="training going on without agent")
        wait_for(lambda: mon.stats.backlog_records > 0, what="steps kept while no agent listens")
        restarted = start_agent(tmp_path, "--simulate", "1", "--interval", "0.5",
                                port=agent.port)
        try:
            assert restarted.socket_path == agent.socket_path
            wait_for(lambda: values(restarted.metrics(), "gpumon_steps_total", run="restart"),
                     what="steps flowing to the restarted agent")
            wait_for(lambda: mon.stats.backlog_records == 0, what="the backlog sent")
            assert mon.stats.dropped == {} and mon.stats.late_records > 0
        finally:
            stop.set()
            trainer.join(30)
            restarted.stop()
    finally:
        stop.set()
        trainer.join(30)
        mon.close()
    assert errors == []
    assert not trainer.is_alive()
    # Never blocked: no step took anywhere near a socket timeout while the agent was gone.
    assert max(step_times) < 2.0
