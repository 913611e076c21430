"""Other users: the agent runs as an unprivileged user (nobody), serving, creating its socket
0660 under its own uid and stopping cleanly; and a root agent receives from a non-root job
through the socket's group, with each user's ranks kept apart.

The test interpreter may live where other users cannot enter, so the agent runs on the
system's Python with gpumon and its dependencies copied into a world-readable directory.
"""

from __future__ import annotations

import grp
import importlib.metadata
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.helpers import ROOT, free_port, http_get, start_agent, value, values, wait_for


def dependency_closure(name: str, seen: set[str] | None = None) -> set[str]:
    """Names of the installed distributions ``name`` needs at run time (no extras)."""
    seen = set() if seen is None else seen
    key = name.lower().replace("_", "-")
    if key in seen:
        return seen
    seen.add(key)
    for text in importlib.metadata.distribution(name).requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            dependency_closure(req.name, seen)
    return seen


def world_readable_site(target: Path) -> None:
    """gpumon's source and every runtime dependency's installed files under ``target``."""
    shutil.copytree(ROOT / "gpumon", target / "gpumon",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in dependency_closure("gpumon") - {"gpumon"}:
        dist = importlib.metadata.distribution(name)
        for file in dist.files or []:
            source = Path(dist.locate_file(file))
            if source.is_file() and ".." not in file.parts:
                (target / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target / file)
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def test_agent_runs_as_nobody() -> None:
    # The system's interpreter (same minor version as this one: compiled dependencies match).
    python = shutil.which(f"python3.{sys.version_info.minor}", path="/usr/local/bin:/usr/bin:/bin")
    assert python, f"no system python3.{sys.version_info.minor}: apt-get install python3"
    assert os.geteuid() == 0, "starting a process as another user needs root"
    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="gpumon-unpriv-"))
    try:
        base.chmod(0o755)
        world_readable_site(base / "site")
        run = base / "run"
        run.mkdir()
        os.chown(run, nobody.pw_uid, nobody.pw_gid)
        port = free_port()
        socket_path = run / "ingest.sock"
        env = {"PYTHONPATH": str(base / "site"), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
               "HOME": str(run), "LD_LIBRARY_PATH": ""}
        log = (base / "agent.log").open("wb")
        process = subprocess.Popen(
            [python, "-m", "gpumon.cli", "agent", "--simulate", "1", "--address", "127.0.0.1",
             "--port", str(port), "--socket", str(socket_path)],
            cwd=run, env=env, user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: process.poll() is None
                     and http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200,
                     timeout=30, what="the unprivileged agent")
            status, body = http_get(f"http://127.0.0.1:{port}/metrics")
            assert status == 200 and b"gpumon_gpu_up" in body
            info = socket_path.stat()
            assert info.st_uid == nobody.pw_uid
            assert stat.S_IMODE(info.st_mode) == 0o660
            with open(f"/proc/{process.pid}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
            assert set(uids) == {str(nobody.pw_uid)}
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(15)
            log.close()
        assert code == 0, (base / "agent.log").read_text()
        assert not socket_path.exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --- a second user sending to a root agent's socket ----------------------------------------

SENDER = """
import json, socket, sys
path, payload = sys.argv[1], json.loads(sys.argv[2])
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    for datagram in payload:
        s.sendto(json.dumps(datagram).encode(), path)
"""


def send_as_nobody(socket_path: Path, datagrams: list[object]) -> subprocess.CompletedProcess[str]:
    """Send datagrams from a process of the user nobody (its kernel credentials are nobody's)."""
    nobody = pwd.getpwnam("nobody")
    return subprocess.run(["/usr/bin/python3", "-c", SENDER, str(socket_path), json.dumps(datagrams)],
                          user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
                          capture_output=True, text=True, timeout=30, cwd="/")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can reach (the test's tmp_path is private to root)."""
    assert os.geteuid() == 0, "sending as another user needs root"
    base = Path(tempfile.mkdtemp(prefix="gpumon-shared-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def a_step(run: str, rank: int, n: int = 0, **extra: object) -> dict[str, object]:
    return {"v": 1, "kind": "step", "run": run, "rank": rank, "step": n, "duration": 0.2,
            "t_start": time.time() - 0.2, **extra}


def test_socket_group_lets_a_non_root_job_send(shared_dir: Path) -> None:
    agent = start_agent(shared_dir, "--simulate", "1", "--socket-group", "nogroup")
    try:
        info = agent.socket_path.stat()
        assert info.st_gid == grp.getgrnam("nogroup").gr_gid
        assert stat.S_IMODE(info.st_mode) == 0o660
        sent = send_as_nobody(agent.socket_path, [a_step("nobody-job", 0)])
        assert sent.returncode == 0, sent.stderr
        m = wait_for(lambda: (lambda m: values(m, "gpumon_steps_total", run="nobody-job") and m)(
            agent.metrics()), what="the non-root job's step")
        assert value(m, "gpumon_ingest_up") == 1
        assert value(m, "gpumon_ingest_socket_info", path=str(agent.socket_path),
                     group="nogroup", mode="0660") == 1
    finally:
        assert agent.stop() == 0, agent.log()


def test_without_a_group_the_refusal_shows_on_the_agent(shared_dir: Path) -> None:
    assert "gpumon" not in {g.gr_name for g in grp.getgrall()}, "this node has a gpumon group"
    agent = start_agent(shared_dir, "--simulate", "1")
    try:
        sent = send_as_nobody(agent.socket_path, [a_step("nobody-job", 0)])
        assert sent.returncode != 0 and "PermissionError" in sent.stderr
        # The agent never sees the refused sender; what it can say is who may send.
        assert value(agent.metrics(), "gpumon_ingest_socket_info", group="root",
                     mode="0660") == 1
    finally:
        assert agent.stop() == 0, agent.log()


def test_one_users_flood_of_fake_ranks_does_not_lock_out_the_next_job(shared_dir: Path) -> None:
    agent = start_agent(shared_dir, "--simulate", "1", "--socket-group", "nogroup")
    try:
        # 14 datagrams of hello records: 1,400 fake (run, rank) pairs, over the 1,024 cap.
        flood = [[{"v": 1, "kind": "hello", "run": f"spam-{d}", "rank": r} for r in range(100)]
                 for d in range(14)]
        assert send_as_nobody(agent.socket_path, flood).returncode == 0
        wait_for(lambda: sum(values(agent.metrics(), "gpumon_ingest_records_total",
                                    kind="hello")) == 1024, what="the flood ingested")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:  # root's real job
            s.sendto(json.dumps([a_step("real-job", r) for r in range(8)]).encode(),
                     str(agent.socket_path))
        m = wait_for(lambda: (lambda m: len(values(m, "gpumon_steps_total", run="real-job")) == 8
                              and m)(agent.metrics()), what="every rank of the real job")
        assert value(m, "gpumon_ingest_dropped_total", reason="too_many_ranks") == 1400 - 1024
        assert value(m, "gpumon_ingest_ranks_evicted_total", reason="over_share") == 8
    finally:
        assert agent.stop() == 0, agent.log()


def test_another_user_cannot_forge_a_run_it_does_not_own(shared_dir: Path) -> None:
    agent = start_agent(shared_dir, "--simulate", "1", "--socket-group", "nogroup")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps([a_step("victim", r, flops=1e12) for r in range(3)]).encode(),
                     str(agent.socket_path))
        wait_for(lambda: len(values(agent.metrics(), "gpumon_steps_total", run="victim")) == 3)
        forged = [{"v": 1, "kind": "event", "event": "oom", "run": "victim", "rank": 0},
                  a_step("victim", 1, n=1, flops=1e30),
                  a_step("victim", 2, n=1, t_start=time.time() + 86_000.0),
                  {"v": 1, "kind": "hello", "run": "victim", "rank": 2, "pid": 1}]
        assert send_as_nobody(agent.socket_path, [forged]).returncode == 0
        m = wait_for(lambda: (lambda m: values(m, "gpumon_ingest_dropped_total",
                                               reason="not_owner") and m)(agent.metrics()),
                     what="the forged records counted")
        assert value(m, "gpumon_ingest_dropped_total", reason="not_owner") == 4
        assert value(m, "gpumon_torch_ooms_total", run="victim", rank="0") == 0
        assert value(m, "gpumon_steps_total", run="victim", rank="1") == 1
        assert value(m, "gpumon_step_flops_total", run="victim", rank="1") == 1e12
        last = value(m, "gpumon_step_last_timestamp_seconds", run="victim", rank="2")
        assert abs(last - time.time()) < 60
        # The rank's process is the one the kernel says sent its records: ours.
        assert value(m, "gpumon_rank_info", run="victim", rank="2", pid=str(os.getpid())) == 1
    finally:
        assert agent.stop() == 0, agent.log()
