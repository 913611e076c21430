"""The owners cycle keeps a live process's facts between cycles, and reads them again for
another process under the same pid, and after ``FACTS_KEPT_S``; on a /proc tree of files, and
on this machine's /proc against ``read_process``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumon.agent import owners
from gpumon.agent.owners import OwnerCollector
from gpumon.collectors.process_owner import read_process
from gpumon.state.owners import OwnerState

PID = 4242


def _process(proc: Path, job: str) -> None:
    """Process PID of Slurm job ``job``, made anew (a new directory, as a new process's)."""
    shutil.rmtree(proc / str(PID), ignore_errors=True)
    time.sleep(0.02)  # another inode time than the last directory's
    (proc / str(PID)).mkdir(parents=True)
    (proc / str(PID) / "cgroup").write_text(
        f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n")
    (proc / str(PID) / "status").write_text(f"Name:\tpython\nUid:\t{os.getuid()}\t0\t0\t0\n")


def _job(state: OwnerState) -> str:
    return state.get().by_pid[PID].slurm_job


def test_a_process_is_read_once_until_its_pid_is_another_processs(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _process(proc, "1")
    state = OwnerState("node")
    collector = OwnerCollector(state, "/nonexistent.sock", containers_dir=str(tmp_path), proc=proc)
    collector.collect([PID])
    assert _job(state) == "1"
    (proc / str(PID) / "cgroup").write_text(  # the same process: not read again
        "0::/system.slice/slurmstepd.scope/job_2/step_0/user/task_0\n")
    collector.collect([PID])
    assert _job(state) == "1"
    _process(proc, "3")  # the pid is another process's now
    collector.collect([PID])
    assert _job(state) == "3"


def test_facts_are_read_again_after_they_were_kept_long_enough(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = tmp_path / "proc"
    _process(proc, "1")
    state = OwnerState("node")
    collector = OwnerCollector(state, "/nonexistent.sock", containers_dir=str(tmp_path), proc=proc)
    collector.collect([PID])
    (proc / str(PID) / "cgroup").write_text(  # moved to another cgroup while it runs
        "0::/system.slice/slurmstepd.scope/job_2/step_0/user/task_0\n")
    monkeypatch.setattr(owners, "FACTS_KEPT_S", 0.0)
    collector.collect([PID])
    assert _job(state) == "2"


def test_on_this_machine_kept_facts_are_the_processs_own(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        state = OwnerState("node")
        collector = OwnerCollector(state, "/nonexistent.sock", containers_dir=str(tmp_path))
        for _ in range(2):
            collector.collect([child.pid, os.getpid()])
        fresh = {pid: read_process(pid) for pid in (child.pid, os.getpid())}
        kept = state.get().by_pid
        assert {pid: (kept[pid].user, kept[pid].slurm_job) for pid in fresh} == {
            pid: (f.user, f.place.slurm_job) for pid, f in fresh.items() if f is not None}
    finally:
        child.kill()
        child.wait()
    collector.collect([child.pid])  # gone: its facts are not kept
    assert child.pid not in collector._kept
