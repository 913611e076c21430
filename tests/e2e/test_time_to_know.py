"""Time to know, end to end, with the shipped configuration: from the moment a rank of a real
job misbehaves to the moment the notification reaches a webhook receiver.

Three real 2-rank DDP jobs on gloo under ``torch.distributed.run`` (``jobs/hang_job.py``, hooked
with ``StepMonitor``) report to one real agent, scraped by a real Prometheus loading the real
``alerts/gpumon.rules.yml`` (nothing compressed) with the scrape and evaluation intervals of
``deploy/compose/prometheus.yml``, sending to a real Alertmanager running
``deploy/alertmanager/alertmanager.yml`` (its routes, group waits and inhibitions; only the
receivers' URLs point here). The hooks keep their shipped stall floor. The jobs run side by
side, one story each:

* ``killed``: rank 1 is killed with SIGKILL; torchrun stops rank 0 at once. GpumonRankExited
  must arrive within 30 s, naming the rank's last step and place.
* ``stuck``: rank 1 deadlocks in user code inside its forward (``apply_adapter``), rank 0
  waits for it in the all-reduce. GpumonTrainingStalled must arrive within 60 s, naming the
  stuck rank and its place.
* ``eval``: both ranks evaluate for 60 s (forwards under ``no_grad``, no step), three times
  the stall floor, then train on. They must be seen ``evaluating``, and nothing about the run
  may arrive.
* ``slowed``: after a minute of even steps, rank 1's device work takes half as long again
  (its steps' own work 1.5× rank 0's). GpumonRankStraggler must arrive within 3 minutes for
  rank 1 alone, with the cause its agent names (compute).
* ``normal``: a healthy run of 0.5 s steps for 10 minutes, rank 0 saving a 5 s checkpoint
  every 50 steps (its peer waits for it), and a 2-minute evaluation pass. Nothing about it
  may arrive.
* ``leak``: memory growing to the limit. CPU torch has no GPU memory to grow, so this one job
  is the simulator's (``gpumon demo``'s node: simulated GPUs, a simulated job of 2 ranks whose
  per-step peak grows from 60 % to 99 % of capacity over ``LEAK_S``, at real speed), scraped
  by the same Prometheus with the same rules. A warning about its memory must arrive before
  the peak reaches capacity (the end of the leak).

The figures go in docs/reliability.md ("Time to know").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpumon.testing import AgentProcess, free_port, start_agent
from gpumon.testing.metrics import series
from gpumon.testing.processes import kill_tree
from tests.e2e.test_alert_pipeline import AlertmanagerProcess, DemoNode, Receiver
from tests.helpers import ROOT, launch_service, require_tool, start_prometheus, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.waits]

JOB = Path(__file__).resolve().parent / "jobs" / "hang_job.py"
RULES = ROOT / "alerts" / "gpumon.rules.yml"
PROMETHEUS = ROOT / "deploy" / "compose" / "prometheus.yml"
ALERTMANAGER = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
EXITED_WITHIN_S = 30.0
STALLED_WITHIN_S = 60.0
EVAL_S = 60.0
QUIET_AFTER_EVAL_S = 30.0
"""After the evaluation, how long nothing may arrive yet (longer than any alert's path)."""
KILL_AFTER_STEPS = 20
SLOWED_WITHIN_S = 180.0
SLOW_AFTER_STEPS = 1000
"""About a minute of even steps first (50 ms of device work a step)."""
NORMAL_S = 600.0
MEMORY_ALERTS = {"GpumonOOMRiskHigh", "GpumonOOMPredicted"}
LEAK_AFTER_S = 60.0
LEAK_S = 480.0
LEAK = f"""
[[phase]]
kind = "compute"
seconds = {LEAK_AFTER_S:g}

[[phase]]
kind = "leak"
seconds = {LEAK_S:g}
peak_ratio = 0.99
"""


class Job:
    """A ``torch.distributed.run`` job of 2 ranks, left running, stopped at the end."""

    def __init__(self, agent: AgentProcess, tmp: Path, run: str, *args: str) -> None:
        self.run, self.out = run, tmp / run
        env = {**os.environ, "GPUMON_SOCKET": str(agent.socket_path), "GPUMON_RUN": run,
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        for name in ("GPUMON_STALL_AFTER_S", "GPUMON_PURE_PYTHON"):
            env.pop(name, None)  # the shipped floor
        self.log = (tmp / f"{run}.log").open("wb")
        self.started = time.time()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()), str(JOB), "--out", str(self.out),
             "--steps", "100000", *args],
            env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def note(self, rank: int) -> dict[str, Any]:
        path = self.out / f"rank{rank}.json"
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return {}

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.log.closed:
            return
        kill_tree(self.process.pid)
        self.process.wait(timeout=30)
        self.log.close()


@dataclass
class Pipeline:
    agent: AgentProcess
    receiver: Receiver
    jobs: dict[str, Job]
    leak: DemoNode
    leak_started: float


def _shipped_alertmanager(tmp: Path, webhook_url: str) -> AlertmanagerProcess:
    config = yaml.safe_load(ALERTMANAGER.read_text())
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = webhook_url
    path = tmp / "alertmanager.yml"
    path.write_text(json.dumps(config))
    port = free_port()
    process = launch_service(
        "alertmanager",
        [require_tool("prometheus-alertmanager"), f"--config.file={path}",
         f"--storage.path={tmp / 'am-data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address="],
        tmp / "alertmanager.log", f"http://127.0.0.1:{port}/-/ready")
    return AlertmanagerProcess(process, port, tmp / "alertmanager.log")


def shipped_interval() -> str:
    """The scrape and evaluation interval of the shipped Prometheus configuration."""
    shipped = yaml.safe_load(PROMETHEUS.read_text())["global"]
    assert shipped["scrape_interval"] == shipped["evaluation_interval"]
    return str(shipped["scrape_interval"])


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    tmp = tmp_path_factory.mktemp("ttk")
    agent = start_agent(tmp)
    receiver = Receiver(lambda: None)
    alertmanager = prometheus = leak = None
    jobs: dict[str, Job] = {}
    try:
        leak = DemoNode.start(tmp, "leak", LEAK, "leak")
        alertmanager = _shipped_alertmanager(tmp, receiver.url)
        prometheus = start_prometheus(tmp, [f"127.0.0.1:{agent.port}", leak.target],
                                      scrape_interval=shipped_interval(),
                                      rule_files=[RULES], alertmanager=f"127.0.0.1:{alertmanager.port}")
        jobs["killed"] = Job(agent, tmp, "killed", "--scenario", "slow", "--stop-after", "-1")
        jobs["stuck"] = Job(agent, tmp, "stuck", "--scenario", "lock", "--rank", "1",
                            "--stop-after", "15")
        jobs["eval"] = Job(agent, tmp, "eval", "--scenario", "eval", "--stop-after", "15",
                           "--eval-s", str(EVAL_S))
        jobs["slowed"] = Job(agent, tmp, "slowed", "--scenario", "slowed", "--rank", "1",
                             "--stop-after", str(SLOW_AFTER_STEPS))
        jobs["normal"] = Job(agent, tmp, "normal", "--scenario", "normal", "--work-ms", "500",
                             "--stop-after", "100", "--eval-s", "120", "--checkpoint-every", "50",
                             "--checkpoint-s", "5")
        leak.job.start()
        yield Pipeline(agent, receiver, jobs, leak, time.time())
    finally:
        if leak is not None:
            leak.stop()
        for job in jobs.values():
            job.stop()
        for service in (prometheus, alertmanager):
            if service is not None:
                service.stop()
        receiver.stop()
        agent.stop()


def _unix(arrived_monotonic: float) -> float:
    return time.time() - (time.monotonic() - arrived_monotonic)


def _rank_states(agent: AgentProcess, run: str) -> dict[str, str]:
    return {labels["rank"]: labels["state"] for labels, v in
            series(agent.metrics(), "gpumon_rank_state", run=run) if v == 1.0}


def test_time_to_know(pipeline: Pipeline) -> None:
    agent, receiver, jobs = pipeline.agent, pipeline.receiver, pipeline.jobs

    # killed: SIGKILL rank 1 once it has stepped a while
    def stepped() -> str | None:
        metrics = agent.metrics()
        steps = dict((labels["rank"], v) for labels, v in series(metrics, "gpumon_steps_total", run="killed"))
        if steps.get("1", 0) < KILL_AFTER_STEPS:
            return None
        info = series(metrics, "gpumon_rank_info", run="killed", rank="1")
        pids = [labels.get("pid") for labels, _ in info]
        return pids[0] if pids and pids[0] else None

    pid = wait_for(stepped, timeout=120, interval=0.5, what="rank 1 of run killed stepping")
    os.kill(int(pid), signal.SIGKILL)
    killed_at = time.time()

    eval_states: set[tuple[str, str]] = set()
    evaluated_at: float | None = None
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        eval_states |= set(_rank_states(agent, "eval").items())
        note = jobs["eval"].note(0)
        if evaluated_at is None and note.get("what") == "eval":
            evaluated_at = note["t"] + EVAL_S
        exited = [a for _, a in receiver.firing("GpumonRankExited") if a["labels"]["run"] == "killed"]
        stalled = [a for _, a in receiver.firing("GpumonTrainingStalled") if a["labels"]["run"] == "stuck"]
        quiet = evaluated_at is not None and time.time() > evaluated_at + QUIET_AFTER_EVAL_S
        if exited and stalled and quiet:
            break
        time.sleep(0.5)
    else:
        names = [(a["labels"]["alertname"], a["labels"].get("run"), a["labels"].get("rank"))
                 for n in receiver.notifications for a in n.payload["alerts"]]
        raise AssertionError(
            f"not everything arrived: exited {bool(exited)}, stalled {bool(stalled)}, evaluation "
            f"over at {evaluated_at}; received {names}; states "
            f"{ {run: _rank_states(agent, run) for run in jobs} }; stuck job: {jobs['stuck'].note(1)}")

    # a rank killed: within 30 s, naming its last step and place
    found = [(n, a) for n, a in receiver.firing("GpumonRankExited") if a["labels"]["run"] == "killed"]
    first = min(n.arrived for n, _ in found)
    exited_s = _unix(first) - killed_at
    ranks = {a["labels"]["rank"]: a for _, a in found}
    assert "1" in ranks, ranks
    description = " ".join(ranks["1"]["annotations"]["description"].split())
    assert "ended without closing its monitor" in description and " steps." in description, description
    assert "last seen in phase" in description and "hang_job.py:" in description, description

    # a rank stuck in user code: within 60 s, naming the rank and its place
    stuck_note = jobs["stuck"].note(1)
    assert stuck_note.get("what") == "lock", stuck_note
    found = [(n, a) for n, a in receiver.firing("GpumonTrainingStalled") if a["labels"]["run"] == "stuck"]
    culprit = [(n, a) for n, a in found if a["labels"]["rank"] == "1"]
    assert culprit, found
    stalled_s = _unix(min(n.arrived for n, _ in culprit)) - stuck_note["t"]
    description = " ".join(culprit[0][1]["annotations"]["description"].split())
    assert "Adapted.apply_adapter" in description and "phase forward" in description, description

    about_eval = [a for n in receiver.notifications for a in n.payload["alerts"]
                  if a["labels"].get("run") == "eval"]
    print(f"time to know: killed rank {exited_s:.1f} s (goal {EXITED_WITHIN_S:.0f}), "
          f"stuck rank {stalled_s:.1f} s (goal {STALLED_WITHIN_S:.0f}), "
          f"{EVAL_S:.0f} s evaluation: {len(about_eval)} alerts; its states {sorted(eval_states)}")
    # an evaluation pass three times the stall floor: evaluating, and nothing arrives
    assert {("0", "evaluating"), ("1", "evaluating")} <= eval_states
    assert not {state for _, state in eval_states} - {"stepping", "evaluating"}, eval_states
    assert about_eval == []
    assert 0 < exited_s <= EXITED_WITHIN_S
    assert 0 < stalled_s <= STALLED_WITHIN_S
    for story in ("killed", "stuck", "eval"):  # the machine's cores to the two left
        jobs[story].stop()


def test_time_to_know_a_slowed_rank_and_a_normal_job(pipeline: Pipeline) -> None:
    agent, receiver, jobs = pipeline.agent, pipeline.receiver, pipeline.jobs
    normal, slowed = jobs["normal"], jobs["slowed"]

    def about(run: str) -> list[tuple[Any, dict[str, Any]]]:
        return [(n, a) for n in receiver.notifications for a in n.payload["alerts"]
                if a["labels"].get("run") == run]

    normal_states: set[tuple[str, str]] = set()
    saves = 0
    leak_end = pipeline.leak_started + LEAK_AFTER_S + LEAK_S
    while time.time() < max(normal.started + NORMAL_S, leak_end):
        normal_states |= set(_rank_states(agent, "normal").items())
        saves = max(saves, normal.note(0).get("steps", 0) // 50)
        time.sleep(1.0)
    assert normal.process.poll() is None, normal.output()

    # a rank slowed by 1.5x: within 3 minutes, that rank alone, with its cause
    slowed_note = slowed.note(1)
    assert slowed.process.poll() is None, slowed.output()
    found = [(n, a) for n, a in about("slowed") if a["labels"]["alertname"] == "GpumonRankStraggler"
             and a["status"] == "firing"]
    assert found and {a["labels"]["rank"] for _, a in found} == {"1"}, \
        [(a["labels"]["alertname"], a["labels"].get("rank")) for _, a in about("slowed")]
    slowed_s = _unix(min(n.arrived for n, _ in found)) - _slowed_at(slowed)
    description = " ".join(found[0][1]["annotations"]["description"].split())
    assert "Its agent names the cause: compute." in description, description
    others = [a["labels"]["alertname"] for _, a in about("slowed")
              if a["labels"]["alertname"] != "GpumonRankStraggler"]

    # memory growing to the limit: a warning about it before the peak reaches capacity
    memory = [(n, a) for n, a in about("leak") if a["labels"]["alertname"] in MEMORY_ALERTS]
    assert memory, [(a["labels"]["alertname"], a["labels"].get("rank")) for _, a in about("leak")]
    first, first_alert = min(memory, key=lambda pair: pair[0].arrived)
    lead_s = leak_end - _unix(first.arrived)
    leak_names = sorted({a["labels"]["alertname"] for _, a in memory})

    # a normal job for 10 minutes: checkpoints, an evaluation, and nothing arrives
    about_normal = [(a["labels"]["alertname"], a["labels"].get("rank")) for _, a in about("normal")]
    print(f"time to know: rank slowed 1.5x {slowed_s:.1f} s (goal {SLOWED_WITHIN_S:.0f}), "
          f"other alerts of that run {others}; normal job {NORMAL_S:.0f} s with {saves} "
          f"checkpoints and an evaluation: {len(about_normal)} alerts; its states "
          f"{sorted(normal_states)}; leak: {first_alert['labels']['alertname']} "
          f"{_unix(first.arrived) - pipeline.leak_started - LEAK_AFTER_S:.0f} s into the "
          f"{LEAK_S:.0f} s leak, {lead_s:.0f} s before capacity (then {leak_names})")
    assert slowed_note.get("what") == "steps"  # still stepping: it was slowed, not stopped
    assert 0 < slowed_s <= SLOWED_WITHIN_S
    assert others == []
    assert saves >= 8
    assert ("0", "evaluating") in normal_states and ("1", "evaluating") in normal_states
    assert about_normal == []
    assert lead_s > 0


def _slowed_at(job: Job) -> float:
    """When the job's rank 1 began its first slowed step (its own note of it, kept aside
    from the notes of every step that follow)."""
    return float(json.loads((job.out / "slowed.json").read_text())["t"])
