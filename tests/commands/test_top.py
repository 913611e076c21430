"""`gpumon top`: the rendered view of a snapshot, and the command in a pseudo-terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from gpumon.agent.config import AgentConfig
from gpumon.agent.lifecycle import Agent
from gpumon.commands.top import render, snapshot_url
from gpumon.sim.gpus import SimulatedSource
from gpumon.sim.job import SimulatedJob
from gpumon.sim.schedule import parse_schedule
from tests.helpers import ROOT, agent_env, free_port, wait_for

GIB = 1024**3

SNAPSHOT: dict[str, Any] = {
    "version": "0.1.0", "t": 1_800_000_000.0,
    "nvml": {"up": True, "driver_version": "550.54.15", "nvml_version": "12.550",
             "simulated": False, "message": None},
    "host": {"cpu_utilization_ratio": 0.25, "memory_used_bytes": 64 * GIB,
             "memory_total_bytes": 512 * GIB},
    "gpus": [
        {"index": 0, "uuid": "GPU-0", "model": "NVIDIA H100 80GB HBM3", "up": True,
         "utilization_ratio": 0.97, "sm_active_ratio": 0.88, "tensor_active_ratio": 0.71,
         "dram_active_ratio": 0.34, "memory_used_bytes": 76 * GIB,
         "memory_total_bytes": 80 * GIB, "nvlink_tx_bytes_per_second": 54.4e9,
         "power_watts": 640.0, "temperature_celsius": 71},
        {"index": 1, "uuid": "GPU-1", "model": "NVIDIA H100 80GB HBM3", "up": False},
        {"index": 2, "uuid": "GPU-2", "model": "NVIDIA H100 PCIe", "up": True,
         "utilization_ratio": 0.05},
    ],
    "ranks": [
        {"run": "llama", "rank": 0, "gpu": "GPU-0", "steps_total": 1234,
         "last_step_duration_seconds": 0.412, "memory_peak_bytes": 72 * GIB,
         "analysis": {"gpu": 0, "bottleneck": "input", "confidence": 0.91,
                      "flags": ["memory_pressure", "straggler"], "mfu": 0.183,
                      "oom": {"risk_ratio": 0.93, "predicted_seconds": 42.4}}},
        {"run": "llama", "rank": 1, "gpu": None, "steps_total": 3},
    ],
}


def text_of(renderable: Any, width: int = 160) -> str:
    console = Console(width=width, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def row(text: str, *cells: str) -> bool:
    """Whether one line of a rendered table holds ``cells`` in order, between borders."""
    pattern = r"\s*│\s*".join(re.escape(c) for c in cells)
    return any(re.search(r"(^|│)\s*" + pattern + r"\s*(│|$)", line) for line in text.splitlines())


def test_render_shows_gpus_ranks_verdicts_and_oom_risk() -> None:
    text = text_of(render(SNAPSHOT, title="gpumon top http://node:9403"))
    assert text.startswith("gpumon top http://node:9403  gpumon 0.1.0  3 GPUs  driver 550.54.15")
    assert row(text, "0", "NVIDIA H100 80GB HBM3", "97%", "88%", "71%", "34%", "76.0/80.0",
               "54.4 GB/s", "640 W", "71 °C")
    assert row(text, "1", "NVIDIA H100 80GB HBM3", "lost")
    assert row(text, "2", "NVIDIA H100 PCIe", "5%", "—", "—", "—", "—/—")  # absent, not 0
    assert row(text, "llama", "0", "—", "0", "1234", "0.41 s", "input", "91%",
               "memory_pressure, straggler", "18%", "72.0", "93%", "42 s")
    assert row(text, "llama", "1", "—", "—", "3", "—", "—", "—", "—", "—", "—", "—", "—")


def test_render_names_the_stragglers_cause_and_whom_its_peers_wait_on() -> None:
    ranks = [
        {"run": "ddp", "rank": 0, "steps_total": 90,
         "analysis": {"bottleneck": "communication", "flags": [], "waiting_on_rank": 3}},
        {"run": "ddp", "rank": 3, "steps_total": 90,
         "analysis": {"bottleneck": "compute", "flags": ["straggler"],
                      "straggler_cause": "input", "waiting_on_rank": None}},
        {"run": "ddp", "rank": 4, "steps_total": 90,  # flagged, cause not (yet) in the snapshot
         "analysis": {"bottleneck": "compute", "flags": ["throttled", "straggler"]}},
    ]
    text = text_of(render({**SNAPSHOT, "ranks": ranks}))
    assert row(text, "ddp", "0", "—", "—", "90", "—", "communication", "—", "waits on rank 3")
    assert row(text, "ddp", "3", "—", "—", "90", "—", "compute", "—", "straggler (input)")
    assert row(text, "ddp", "4", "—", "—", "90", "—", "compute", "—", "throttled, straggler")


def test_render_shows_a_stalled_runs_ranks_and_where_they_are() -> None:
    ranks = [
        {"run": "ddp", "rank": 0, "steps_total": 15,
         "condition": {"state": "stalled", "stalled_seconds": 74.2, "phase": "backward",
                       "location": "train.py:88 train_step", "waits_on_label": "1",
                       "collective": {"op": "all_reduce", "seq": 16}}},
        {"run": "ddp", "rank": 1, "steps_total": 15,
         "condition": {"state": "stalled", "stalled_seconds": 75.0, "phase": "data",
                       "location": "data.py:41 Shards.read_shard", "waits_on_label": "",
                       "collective": None}},
        {"run": "ddp", "rank": 2, "steps_total": 15, "condition": {"state": "exited"}},
    ]
    text = text_of(render({**SNAPSHOT, "ranks": ranks}))
    assert row(text, "ddp", "0", "stalled", "—", "15")
    assert row(text, "ddp", "2", "exited", "—", "15")
    assert ("ddp rank 0: stalled 74 s in backward at train.py:88 train_step, in all_reduce #16, "
            "waiting on rank(s) 1") in text
    assert "ddp rank 1: stalled 75 s in data at data.py:41 Shards.read_shard\n" in text
    assert "ddp rank 2:" not in text


def test_render_says_what_is_missing() -> None:
    bare = {"version": "0.1.0", "gpus": [], "ranks": [],
            "nvml": {"up": False, "message": "libnvidia-ml.so.1 not found", "simulated": False}}
    text = text_of(render(bare))
    assert "no GPU metrics: libnvidia-ml.so.1 not found" in text
    assert "no training steps received yet" in text
    assert "GPUs" not in text.splitlines()[1:]


def _pipeline_rank(rank: int, stage: int, replica: int, own_s: float,
                   bubble: float) -> dict[str, Any]:
    return {"run": "gpt", "rank": rank, "steps_total": 812,
            "analysis": {"bottleneck": "communication" if bubble > 0.3 else "compute",
                         "flags": [], "bubble": bubble, "own_work_seconds": own_s,
                         "parallel": {"dp": replica, "pp": stage, "source": "pipeline"},
                         "compared_with": "replicas"}}


PIPELINE = [  # two stages of two replicas: the second stage works 0.24 s a step, the first 0.10
    _pipeline_rank(0, 0, 0, 0.10, 0.62), _pipeline_rank(1, 0, 1, 0.11, 0.60),
    _pipeline_rank(2, 1, 0, 0.24, 0.17), _pipeline_rank(3, 1, 1, 0.24, 0.16),
]


@pytest.mark.parametrize("width", [80, 120])
def test_render_shows_each_ranks_layout_bubble_and_the_slowest_stage(width: int) -> None:
    tensor = [{"run": "tp", "rank": 0, "steps_total": 9,
               "analysis": {"own_work_seconds": 0.5, "bubble": None, "compared_with": "replicas",
                            "parallel": {"tp": 0, "dp": 1, "shard": 2, "source": "mesh"}}},
              {"run": "tp", "rank": 1, "steps_total": 9, "analysis": None}]
    plain = {"run": "ddp", "rank": 0, "steps_total": 9,
             "analysis": {"own_work_seconds": 0.3, "parallel": None, "bubble": None,
                          "compared_with": "run"}}
    text = text_of(render({**SNAPSHOT, "ranks": [*PIPELINE, *tensor, plain]}), width=width)
    table = text[text.index("Parallelism"):]
    assert row(table, "gpt", "0", "pp0 dp0", "0.10 s", "62%")
    assert row(table, "gpt", "1", "pp0 dp1", "0.11 s", "60%")
    assert row(table, "gpt", "2", "pp1 dp0", "0.24 s", "17%", "slowest stage")
    assert row(table, "gpt", "3", "pp1 dp1", "0.24 s", "16%", "slowest stage")
    # A tensor-parallel rank: its mesh's own dimension as named; no bubble. A rank of the
    # same run without a layout (yet) is listed, empty.
    assert row(table, "tp", "0", "tp0 dp1 shard2", "0.50 s", "—")
    assert row(table, "tp", "1", "—", "—", "—")
    assert not row(table, "ddp", "0")  # a run that does not split its model: not here
    # (0.24 ÷ the stages' mean of 0.105 and 0.24)
    assert ("gpt: stage 1 is the slowest pipeline stage, 0.24 s of own work per step, 1.39× the "
            "stages' mean; the other stages wait for it in their bubble") in " ".join(
                table.split())
    assert "tp: stage" not in text
    assert max(len(line) for line in table.splitlines()) <= width


def test_render_leaves_the_parallelism_out_for_runs_that_do_not_split_their_model() -> None:
    text = text_of(render(SNAPSHOT))
    assert "Parallelism" not in text and "slowest" not in text
    one_stage = [{**r, "analysis": {**r["analysis"], "parallel": {"pp": 0, "dp": r["rank"]}}}
                 for r in PIPELINE]
    text = text_of(render({**SNAPSHOT, "ranks": one_stage}))
    assert row(text, "gpt", "2", "pp0 dp2", "0.24 s", "17%", "")  # one stage: none is slowest
    assert "slowest" not in text


def _feed_pipeline(socket_path: str, stop: threading.Event) -> None:
    """Two pipeline stages as the hook reports them: stage 0 works 0.06 s of each 0.2 s step and
    waits 0.12 s of the rest to receive from stage 1, which works 0.18 s."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for rank in (0, 1):
        sock.sendto(json.dumps({"v": 1, "kind": "hello", "run": "pipe", "rank": rank, "world": 2,
                                "parallel": {"pp": rank, "source": "pipeline"}}).encode(),
                    socket_path)
    step = 0
    while not stop.wait(0.05):
        for rank, (wait, bubble) in enumerate(((0.14, 0.12), (0.02, 0.01))):
            sock.sendto(json.dumps({
                "v": 1, "kind": "step", "run": "pipe", "rank": rank, "world": 2, "step": step,
                "t_start": time.time() - 0.2, "duration": 0.2,
                "phases": {"forward": 0.1, "backward": 0.1},
                "comm": {"exposed": wait, "busy": wait, "bubble": bubble,
                         "ops": {"send": [4, 2**20, 0.004], "recv": [4, 2**20, wait]}},
            }).encode(), socket_path)
        step += 1
    sock.close()


def test_the_live_snapshot_shows_a_pipelines_layout_bubble_and_slowest_stage(
        tmp_path: Path) -> None:
    """What the agent's rank view carries is what the view reads."""
    agent = Agent(AgentConfig(address="127.0.0.1", port=0, simulate=1, interval=0.25,
                              socket=str(tmp_path / "s.sock")))
    agent.start()
    stop = threading.Event()
    feeder = threading.Thread(target=_feed_pipeline, args=(agent.config.socket, stop),
                              daemon=True)
    feeder.start()
    try:
        def analysed() -> list[Any]:
            ranks = [r for r in agent.snapshot()["ranks"] if r["run"] == "pipe"]
            return [r for r in ranks if (r["analysis"] or {}).get("own_work_seconds")
                    and r["analysis"].get("bubble") is not None]

        wait_for(lambda: len(analysed()) == 2, timeout=20, what="both stages analysed")
        text = text_of(render(agent.snapshot()))
    finally:
        stop.set()
        feeder.join(5)
        agent.stop()
    assert row(text, "pipe", "0", "pp0", "0.06 s", "60%", "")
    assert row(text, "pipe", "1", "pp1", "0.18 s", "5%", "slowest stage")
    assert ("pipe: stage 1 is the slowest pipeline stage, 0.18 s of own work per step, 1.50× "
            "the stages' mean") in text


def test_snapshot_url_accepts_agent_addresses_only() -> None:
    assert snapshot_url("http://10.0.0.7:9403") == "http://10.0.0.7:9403/api/v1/snapshot"
    assert snapshot_url("https://node/") == "https://node/api/v1/snapshot"
    for bad in ("10.0.0.7:9403", "ftp://node", "http://"):
        with pytest.raises(ValueError, match="expected the agent's address"):
            snapshot_url(bad)


# --- the command, in a pseudo-terminal ------------------------------------------------------

ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-Za-z]|[=>78])")


class PtyProcess:
    """A command whose stdin/stdout/stderr are a pseudo-terminal of a fixed size."""

    def __init__(self, args: list[str], columns: int = 160, lines: int = 50) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        env = agent_env(extra={"TERM": "xterm-256color", "COLUMNS": str(columns),
                               "LINES": str(lines)})
        self.process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env,
                                        cwd=ROOT, start_new_session=True)
        os.close(slave)
        self._master = master
        self.output = ""

    def read(self, timeout_s: float = 0.2) -> str:
        """What the terminal received so far, without escape sequences."""
        raw = b""
        while select.select([self._master], [], [], timeout_s)[0]:
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            raw += chunk
            timeout_s = 0.0
        self.output += ANSI.sub("", raw.decode(errors="replace"))
        return self.output

    def wait_for(self, predicate: Callable[[str], bool], timeout_s: float, what: str) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self.read()):
                return self.output
            assert self.process.poll() is None, f"exited early:\n{self.output}"
        raise AssertionError(f"timed out waiting for {what}; terminal:\n{self.output[-4000:]}")

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.read(0.0)
            os.close(self._master)
        return code


@pytest.fixture
def live_agent(tmp_path: Path) -> Iterator[Agent]:
    """An agent on 3 simulated GPUs with a 2-rank compute-bound job reporting to it."""
    source = SimulatedSource(3)
    agent = Agent(AgentConfig(address="127.0.0.1", port=0, simulate=3, interval=0.25,
                              socket=str(tmp_path / "s.sock")), gpu_source=source)
    agent.start()
    job = SimulatedJob(source, parse_schedule('[[phase]]\nkind = "compute"\nseconds = 60\n'),
                       ranks=2, socket_path=agent.config.socket, run="ptyjob")
    job.start()
    try:
        yield agent
    finally:
        job.stop()
        agent.stop()


def test_top_in_a_terminal_shows_the_gpus_and_ranks(live_agent: Agent) -> None:
    url = f"http://127.0.0.1:{live_agent.port}"
    top = PtyProcess([sys.executable, "-m", "gpumon.cli", "top", "--url", url,
                      "--interval", "0.5"])
    try:
        def complete(text: str) -> bool:
            frame = text.rsplit("gpumon top", 1)[-1]  # the latest frame
            return all(row(frame, "ptyjob", str(r), "stepping", str(r)) for r in (0, 1)) \
                and frame.count("compute") >= 2
        screen = top.wait_for(complete, 30, "both ranks with a compute verdict")
        frame = screen.rsplit("gpumon top", 1)[-1]
        assert f"{url}  gpumon 0.1.0  3 GPUs (simulated)" in frame
        for index in range(3):
            assert row(frame, str(index), "NVIDIA H100 80GB HBM3")
        assert "Ranks" in frame
    finally:
        code = top.stop(signal.SIGINT)
    assert code == 0, top.output[-2000:]
    assert "Traceback" not in top.output


def test_top_says_once_that_no_agent_answers_then_shows_it_when_it_does(
        tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "top.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "gpumon.cli", "top", "--url", url,
                                    "--interval", "0.2"], stdout=out, stderr=subprocess.STDOUT,
                                   env=agent_env(), cwd=ROOT)
    agent = None
    try:
        wait_for(lambda: "no agent answers" in log.read_text(), timeout=20, what="the message")
        time.sleep(1.5)  # several more attempts, quietly
        printed = " ".join(log.read_text().split())  # unwrapped: not a terminal, 80 columns
        assert printed == (f"gpumon top: no agent answers at {url} ([Errno 111] Connection "
                           "refused); trying again every 0.2 s")
        agent = Agent(AgentConfig(address="127.0.0.1", port=port, simulate=1,
                                  socket=str(tmp_path / "s.sock")))
        agent.start()
        wait_for(lambda: "1 GPU (simulated)" in log.read_text(), timeout=20,
                 what="a frame once the agent answers")
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(10)
        if agent is not None:
            agent.stop()
    assert code == 0, log.read_text()


def test_top_once_prints_one_frame_for_scripts(live_agent: Agent) -> None:
    url = f"http://127.0.0.1:{live_agent.port}"
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "top", "--once", "--url", url],
                            capture_output=True, text=True, env=agent_env(), cwd=ROOT, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"gpumon top {url}") == 1 and "3 GPUs (simulated)" in result.stdout
    down = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "top", "--once", "--url", down],
                            capture_output=True, text=True, env=agent_env(), cwd=ROOT, timeout=30)
    assert result.returncode == 1 and result.stdout == ""
    assert " ".join(result.stderr.split()) == (f"gpumon top: no agent answers at {down}: "
                                               "[Errno 111] Connection refused")


def test_top_quits_on_q(live_agent: Agent) -> None:
    url = f"http://127.0.0.1:{live_agent.port}"
    top = PtyProcess([sys.executable, "-m", "gpumon.cli", "top", "--url", url,
                      "--interval", "0.5"])
    try:
        top.wait_for(lambda text: "q quits" in text, 30, "the live view")
        os.write(top._master, b"q")
        code = top.process.wait(10)
    finally:
        top.stop()
    assert code == 0, top.output[-2000:]


def test_top_refuses_a_url_that_is_not_an_agent_address() -> None:
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "top", "--url", "node:9403"],
                            capture_output=True, text=True, env=agent_env(), cwd=ROOT, timeout=30)
    assert result.returncode == 2
    assert "gpumon: error: --url 'node:9403': expected the agent's address" in result.stderr


def test_render_says_whose_each_rank_is() -> None:
    pod = {"node": "gpu-node-1", "pod": "llm-0", "namespace": "research", "container": "trainer",
           "slurm_job": "", "slurm_step": "", "user": "alice"}
    slurm = {"node": "hpc-17", "pod": "", "namespace": "", "container": "", "slurm_job": "7731",
             "slurm_step": "0", "user": "bob"}
    ranks = [{"run": "llm", "rank": 0, "steps_total": 5, "owner": pod},
             {"run": "llm", "rank": 1, "steps_total": 5, "owner": pod},
             {"run": "sim", "rank": 0, "steps_total": 5, "owner": slurm},
             {"run": "bare", "rank": 0, "steps_total": 5, "owner": {"node": "", "user": ""}}]
    text = text_of(render({**SNAPSHOT, "ranks": ranks}))
    assert ("llm ranks 0, 1: pod research/llm-0 (trainer), user alice, node gpu-node-1"
            in text), text
    assert "sim rank 0: Slurm job 7731.0, user bob, node hpc-17" in text
    assert "bare rank" not in text  # nothing known: no line


def test_stacks_name_each_ranks_owner() -> None:
    from gpumon.commands.stacks import render as render_stacks
    from gpumon.commands.stacks import stacks_document

    owner = {"node": "hpc-17", "slurm_job": "7731", "slurm_step": "0", "user": "bob"}
    snapshot = {"t": 1.0, "ranks": [{"run": "sim", "rank": 2, "pid": 981, "steps_total": 9,
                                     "owner": owner}]}
    text = render_stacks(stacks_document(snapshot))
    assert "rank 2 (pid 981, Slurm job 7731.0, user bob, node hpc-17): stepping, 9 steps" in text


def test_the_live_snapshot_carries_the_agents_node_and_the_senders_user(
        live_agent: Agent) -> None:
    """The simulated job sends from this process: the kernel gives the agent its pid and uid."""
    from gpumon.collectors.process_owner import user_name

    def owners() -> list[Any]:
        return [r["owner"] for r in live_agent.snapshot()["ranks"] if r["owner"]["user"]]

    (owner, *_) = wait_for(owners, timeout=15, what="an attributed rank")
    assert owner["user"] == user_name(os.getuid())
    assert owner["node"] == live_agent.owners.get().node
