"""`--record`: every step record and GPU sample lands in the JSONL file within a second."""

from __future__ import annotations

import json
import resource
import socket
import stat
from pathlib import Path

import pytest

from gpumon.agent.config import AgentConfig
from gpumon.agent.lifecycle import Agent
from gpumon.agent.recorder import Recorder, gpu_line, sample_from_line
from gpumon.wire import StepRecord
from tests.helpers import start_agent, value, wait_for


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


def test_sample_from_line_takes_what_the_line_holds() -> None:
    """Every recorded key, a null, the processes and ``up``, as ``GpuSample(**fields)``
    takes them; a line without its GPU or time is refused as before."""
    from gpumon.collectors.samples import GpuSample

    line = {"kind": "gpu", "t": 3, "gpu": "2", "utilization": 0.5, "power_watts": None,
            "memory_used_bytes": 7, "processes": {"12": 3.0}, "up": False, "unknown": 1}
    assert sample_from_line(line) == GpuSample(
        index=2, t=3.0, up=False, utilization_ratio=0.5, memory_used_bytes=7,
        process_memory_bytes={12: 3})
    assert type(sample_from_line(line).t) is float
    assert sample_from_line({"t": 1.0, "gpu": 0}) == GpuSample(index=0, t=1.0)
    for bad in ({"t": 1.0}, {"gpu": 0}, {"t": "x", "gpu": 0}, {"t": 1.0, "gpu": 0,
                                                              "processes": {"a": 1}}):
        with pytest.raises((KeyError, TypeError, ValueError)):
            sample_from_line(bad)


def test_unwritable_recording_is_a_clear_error(tmp_path: Path) -> None:
    from gpumon.agent.lifecycle import AgentError

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


def send_steps(path: Path, run: str, steps: range) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for n in steps:
            s.sendto(json.dumps({"v": 1, "kind": "step", "run": run, "rank": 0, "step": n,
                                 "duration": 0.1}).encode(), str(path))


def recorded_steps(path: Path) -> list[int]:
    """Step numbers of a recording; every line must be whole JSON."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line["step"] for line in lines if line["kind"] == "step"]


def test_a_full_disk_is_seen_and_nothing_is_lost_when_space_returns(tmp_path: Path) -> None:
    recording = tmp_path / "run.jsonl"
    agent = start_agent(tmp_path, "--simulate", "1", "--interval", "0.2",
                        "--record", str(recording))
    try:
        wait_for(lambda: recording.stat().st_size > 20_000, what="a recording under way")
        # The kernel refuses writes past this size (EFBIG), as a full disk refuses them
        # (ENOSPC): short writes, then errors. The agent's log is far below it.
        limit = recording.stat().st_size + 4096
        resource.prlimit(agent.process.pid, resource.RLIMIT_FSIZE,
                         (limit, resource.RLIM_INFINITY))
        send_steps(agent.socket_path, "disk", range(0, 200))
        status, body = wait_for(lambda: (lambda r: r[1]["status"] == "degraded" and r)(
            agent.json("/readyz")), what="readiness degraded")
        assert any(p.startswith(f"recording: cannot write {recording}: File too large")
                   for p in body["problems"]), body
        m = agent.metrics()
        assert value(m, "gpumon_recording_up") == 0
        assert value(m, "gpumon_recording_write_errors_total") >= 1
        assert value(m, "gpumon_recording_backlog_bytes") > 0
        # Space comes back: what waited is written, and writing goes on.
        resource.prlimit(agent.process.pid, resource.RLIMIT_FSIZE,
                         (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        wait_for(lambda: agent.json("/readyz")[1]["status"] == "ok", what="readiness back")
        send_steps(agent.socket_path, "disk", range(200, 300))
        wait_for(lambda: len(recorded_steps(recording)) == 300, what="every step recorded")
        m = agent.metrics()
        assert value(m, "gpumon_recording_up") == 1
        assert value(m, "gpumon_recording_dropped_lines_total") == 0
        assert value(m, "gpumon_recording_backlog_bytes") == 0
    finally:
        assert agent.stop() == 0, agent.log()
    assert recorded_steps(recording) == list(range(300))  # in order, no line torn
    assert "writing again after" in agent.log()


def test_a_recording_that_cannot_be_written_at_exit_still_exits_cleanly(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, "--simulate", "1", "--record", "/dev/full")
    try:
        send_steps(agent.socket_path, "full", range(5))
        wait_for(lambda: any("No space left on device" in p
                             for p in agent.json("/readyz")[1]["problems"]),
                 what="the write failure in /readyz")
    finally:
        code = agent.stop()
    assert code == 0, agent.log()
    assert "Traceback" not in agent.log()
    assert "recording /dev/full: " in agent.log() and "lines could not be written" in agent.log()


def test_an_appended_session_starts_on_a_fresh_line(tmp_path: Path) -> None:
    recording = tmp_path / "run.jsonl"
    recording.write_text('{"kind":"step","v":1,"run":"a","rank":0,"step":0,"duration":0.1}\n'
                         '{"kind":"gpu","t":17')  # the last line of an agent killed mid-write
    recorder = Recorder(recording)
    recorder.steps([StepRecord(run="b", rank=0, step=1, duration_s=0.1)])
    recorder.close()
    lines = recording.read_text().splitlines()
    assert lines[1] == '{"kind":"gpu","t":17'  # torn, but alone on its line
    assert json.loads(lines[2])["run"] == "b"
    assert len(lines) == 3


def test_a_recording_is_created_private_and_never_through_a_symlink(tmp_path: Path) -> None:
    from gpumon.agent.lifecycle import AgentError

    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    link = tmp_path / "run.jsonl"
    link.symlink_to(target)
    node = Agent(AgentConfig(address="127.0.0.1", port=0, simulate=1,
                             socket=str(tmp_path / "s.sock"), record=str(link)))
    with pytest.raises(AgentError, match="it is a symbolic link, and a recording is never "
                                         "written through one"):
        node.start()
    node.stop()
    assert target.read_text() == "precious\n"
    fresh = tmp_path / "fresh.jsonl"
    Recorder(fresh).close()
    assert stat.S_IMODE(fresh.stat().st_mode) & 0o007 == 0  # nothing for other users
