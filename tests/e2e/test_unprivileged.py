"""The agent runs as an unprivileged user (nobody): it serves, creates its socket 0660 under
its own uid, and stops cleanly.

The test interpreter may live where other users cannot enter, so the agent runs on the
system's Python with gpumon and its dependencies copied into a world-readable directory.
"""

from __future__ import annotations

import importlib.metadata
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

from tests.helpers import ROOT, free_port, http_get, wait_for


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
