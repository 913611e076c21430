"""`--record`: every step record and GPU sample lands in the JSONL file within a second."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from gpumon.agent import Agent
from gpumon.agent.config import AgentConfig
from gpumon.agent.recorder import gpu_line, sample_from_line
from tests.helpers import wait_for


def test_agent_records_steps_and_gpu_samples(tmp_path: Path) -> None:
    recording = tmp_path / "run.jsonl"
    node = Agent(AgentConfig(address="127.0.0.1", port=0, simulate=2, interval=0.2,
                             socket=str(tmp_path / "s.sock"), record=str(recording)))
    node.start()
    try:
        step = {"v": 1, "kind": "step", "run": "rec", "rank": 3, "step": 7, "duration": 0.25,
                "phases": {"forward": 0.1}}
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps(step).encode(), node.config.socket)

        def lines() -> list[dict]:
            text = recording.read_text()
            return [json.loads(line) for line in text.splitlines()]

        wait_for(lambda: any(line["kind"] == "step" for line in lines()), what="recorded step")
    finally:
        node.stop()
    recorded = lines()
    steps = [line for line in recorded if line["kind"] == "step"]
    assert steps == [{"v": 1, "kind": "step", "run": "rec", "rank": 3, "step": 7,
                      "duration": 0.25, "phases": {"forward": 0.1}}]
    gpus = [line for line in recorded if line["kind"] == "gpu"]
    assert {line["gpu"] for line in gpus} == {0, 1}
    assert all(0 <= line["utilization"] <= 1 and line["memory_total_bytes"] > 0 for line in gpus)


def test_gpu_line_round_trips() -> None:
    from gpumon.collectors.samples import GpuSample

    sample = GpuSample(index=1, t=12.5, utilization_ratio=0.5, sm_active_ratio=0.25,
                       nvlink_tx_bytes_per_second=1e9, power_watts=300.0)
    assert sample_from_line(json.loads(json.dumps(gpu_line(sample)))) == sample


def test_unwritable_recording_is_a_clear_error(tmp_path: Path) -> None:
    from gpumon.agent import AgentError

    node = Agent(AgentConfig(address="127.0.0.1", port=0, simulate=1,
                             socket=str(tmp_path / "s.sock"),
                             record=str(tmp_path / "missing-dir" / "r.jsonl")))
    try:
        node.start()
        raise AssertionError("start() should have failed")
    except AgentError as exc:
        assert "cannot open recording" in str(exc) and "No such file or directory" in str(exc)
    finally:
        node.stop()
