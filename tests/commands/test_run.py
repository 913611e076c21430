"""``gpumon run``: the job it starts behaves as without it (stdout byte for byte, exit status,
Ctrl-C to its process group, SIGTERM to its process id), its Python processes are watched (a
``multiprocessing`` spawned child too, DataLoader workers not), the user's ``sitecustomize`` and
``PYTHONPATH`` still apply, and ``GPUMON_RUN_DISABLE=1`` leaves it untouched.

The steps go to a Unix datagram socket this test binds (the real transport, read directly)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumon.client.autowatch import SHIM_DIR
from gpumon.client.core.run_name import script_name as run_name
from gpumon.commands.run import RunError, job_environment
from tests.helpers import ROOT

JOB = Path(__file__).resolve().parent / "jobs" / "plain_loop.py"
TIMEOUT_S = 120


def test_the_run_is_named_after_the_script() -> None:
    assert run_name(["python", "train.py", "--lr", "3"]) == "train"
    assert run_name(["torchrun", "--nproc-per-node", "8", "jobs/train.py"]) == "train"
    assert run_name(["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "x.py"]) == "x"
    assert run_name(["python", "-m", "pkg.train"]) == "pkg.train"
    assert run_name(["./my job!"]) == "my_job_"


def test_the_environment_leads_the_users_pythonpath_and_names_the_run() -> None:
    env, name, path = job_environment({"PYTHONPATH": "/theirs", "GPUMON_RUN": "set"}, None, "/s.sock",
                                      ["python", "train.py"])
    assert env["PYTHONPATH"] == f"{SHIM_DIR}{os.pathsep}/theirs"
    assert (name, env["GPUMON_RUN"], path, env["GPUMON_SOCKET"]) == ("set", "set", "/s.sock", "/s.sock")
    env, name, _ = job_environment({}, "given", None, ["python", "train.py"])
    assert name == "given" and env["PYTHONPATH"] == str(SHIM_DIR)
    env, name, _ = job_environment({"SLURM_JOB_ID": "88"}, None, None, ["python", "train.py"])
    assert name == env["GPUMON_RUN"] == "slurm-88"  # the job's name before the script's
    with pytest.raises(RunError) as bad:
        job_environment({}, "no spaces", None, ["python", "train.py"])
    assert bad.value.exit_code == 2


def cli(*args: str, env: dict[str, str] | None = None) -> list[str]:
    return [sys.executable, "-m", "gpumon.cli", "run", *args]


def test_no_command_or_a_missing_one_is_a_clear_error() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cli(env=env), env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2 and "give the command" in done.stderr
    done = subprocess.run(cli("--", "no-such-command-here", env=env), env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 127 and "no-such-command-here: command not found" in done.stderr


class Sink:
    """A Unix datagram socket bound where the job sends its steps."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.records: list[dict[str, Any]] = []

    def drain(self, settle_s: float = 1.5) -> list[dict[str, Any]]:
        """Everything received until nothing came for ``settle_s``."""
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < settle_s:
            try:
                data = json.loads(self.sock.recv(65536))
            except TimeoutError:
                continue
            self.records.extend(data if isinstance(data, list) else [data])
            quiet_since = time.monotonic()
        return self.records

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.drain() if r["kind"] == "step"]

    def receive(self) -> list[dict[str, Any]]:
        """What has arrived so far, after one more datagram or 0.2 s (senders still running)."""
        try:
            data = json.loads(self.sock.recv(65536))
            self.records.extend(data if isinstance(data, list) else [data])
        except TimeoutError:
            pass
        return self.records


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[Sink]:
    s = Sink(tmp_path / "ingest.sock")
    yield s
    s.sock.close()


def job_env(sink: Sink, **more: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPUMON_SOCKET": str(sink.path), "OMP_NUM_THREADS": "1"}
    env.pop("GPUMON_RUN", None)
    env.pop("GPUMON_RUN_DISABLE", None)
    return {**env, **more}


def start(watched: bool, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    job = [sys.executable, str(JOB), *args]
    command = cli("--", *job, env=env) if watched else job
    # As a terminal starts a job: SIGINT at its default, even where this test runs with it
    # ignored (a non-interactive shell's background job), which every child would inherit.
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=ROOT, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def without_our_line(err: str) -> str:
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("gpumon: watching"))


@pytest.mark.slow
def test_stdout_and_exit_status_are_the_jobs(sink: Sink) -> None:
    env = job_env(sink)
    jobs = {(watched, status): start(watched, ["exit", str(status)], env)
            for status in (0, 3) for watched in (False, True)}
    ended = {key: (p.communicate(timeout=TIMEOUT_S), p.returncode) for key, p in jobs.items()}
    for status in (0, 3):
        (bare_out, bare_err), bare_code = ended[(False, status)]
        (out, err), code = ended[(True, status)]
        assert (code, out) == (bare_code, bare_out) and code == status
        assert bare_out.count("main step") == 3
        ours = [line for line in err.splitlines() if line.startswith("gpumon")]
        assert len(ours) == 1 and ours[0].startswith("gpumon: watching run 'plain_loop', steps to ")
        assert without_our_line(err) == bare_err
    steps = sink.steps()
    assert sorted(s["step"] for s in steps) == [0, 0, 1, 1, 2, 2]
    assert {s["run"] for s in steps} == {"plain_loop"}


def wait_ready(process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if line == "ready\n":
            return
    err = process.stderr.read() if process.stderr else ""
    raise AssertionError(f"the job ended first: {process.wait()} {err}")


@pytest.mark.slow
def test_ctrl_c_and_sigterm_reach_the_job_as_without_gpumon(sink: Sink) -> None:
    env = job_env(sink)
    jobs = {(watched, how): start(watched, ["wait"], env)
            for how in ("ctrl-c", "sigterm") for watched in (False, True)}
    results = {}
    for process in jobs.values():
        wait_ready(process)
    # Each watched job trained two steps before it said ready: wait for them to arrive (the
    # hook sends every 0.25 s, and a signal's default action ends a job before its next send).
    watched_pids = {process.pid for (watched, _), process in jobs.items() if watched}
    deadline = time.monotonic() + TIMEOUT_S
    while not all(sum(r["kind"] == "step" and r["pid"] == pid for r in sink.receive()) >= 2
                  for pid in watched_pids):
        assert time.monotonic() < deadline, "the watched jobs' first steps never arrived"
    for (_, how), process in jobs.items():
        if how == "ctrl-c":  # a terminal sends it to the foreground process group
            os.killpg(process.pid, signal.SIGINT)
        else:  # to the process id `gpumon run` was started as
            os.kill(process.pid, signal.SIGTERM)
    for (watched, how), process in jobs.items():
        _, err = process.communicate(timeout=TIMEOUT_S)
        err = without_our_line(err).strip()
        results[(watched, how)] = (process.returncode, err.splitlines()[-1] if err else "")
    for how in ("ctrl-c", "sigterm"):
        assert results[(True, how)] == results[(False, how)]
    assert results[(False, "ctrl-c")][1] == "KeyboardInterrupt"
    assert results[(False, "sigterm")] == (-signal.SIGTERM, "")
    assert {s["pid"] for s in sink.steps()} == watched_pids  # the unwatched jobs sent nothing


@pytest.mark.slow
def test_a_spawned_child_is_watched_and_dataloader_workers_are_not(sink: Sink) -> None:
    env = job_env(sink)
    done = subprocess.run(cli("--run", "spawned", "--", sys.executable, str(JOB), "spawn", env=env), env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    records = sink.drain()
    hellos = {r["pid"] for r in records if r["kind"] == "hello"}
    steps = [r for r in records if r["kind"] == "step"]
    assert len(hellos) == 2  # the parent and its spawned child; not the two workers
    assert sorted(len([s for s in steps if s["pid"] == pid]) for pid in hellos) == [4, 4]
    assert {s["run"] for s in steps} == {"spawned"}


@pytest.mark.slow
def test_disabled_the_job_is_untouched_and_the_users_sitecustomize_still_runs(
    sink: Sink, tmp_path: Path
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import sys\nprint('their sitecustomize', file=sys.stderr)\n")
    env = job_env(sink, PYTHONPATH=f"{theirs}{os.pathsep}{ROOT}")
    done = subprocess.run(cli("--", sys.executable, str(JOB), "exit", "0", env=env), env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    # Once in gpumon's own interpreter, once in the job's, after gpumon's.
    assert done.returncode == 0 and done.stderr.count("their sitecustomize\n") == 2
    assert len(sink.steps()) == 3
    env["GPUMON_RUN_DISABLE"] = "1"
    done = subprocess.run(cli("--", sys.executable, str(JOB), "exit", "0", env=env), env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0 and done.stderr == "their sitecustomize\n" * 2
    assert len(sink.steps()) == 3  # nothing new
