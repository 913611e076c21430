"""The agent under test: ``gpumon agent`` started by the shared harness with its socket in a
scratch directory, its log and ``--record`` file in the results; its endpoints, the replay of
its recording through ``gpumon classify``, and a clean stop (exit 0, no errors in the log)."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from gpumon.testing import AgentProcess, http_get, start_agent

from .report import Report, run_cmd


def start(report: Report, result: dict[str, Any], env: dict[str, str], scratch: Path) -> AgentProcess:
    """Start the agent (1 s interval, recording every step and GPU sample), wait until ready."""
    args = ["--interval", "1.0", "--record", str(report.out / "recording.jsonl"), "--log-level", "info"]
    result["args"] = args
    agent = start_agent(scratch, *args, env=env, socket_path=scratch / "ingest.sock",
                        log_path=report.out / "agent.log", ready_timeout=30.0,
                        new_session=True)
    report.children.append(agent.process)
    result["readyz"] = agent.json("/readyz")[1]
    time.sleep(1.5)  # a GPU sample and a host sample before the first steps
    return agent


def cpu_seconds(agent: AgentProcess) -> float | None:
    """User + system CPU seconds of the agent so far (None if psutil cannot read it)."""
    try:
        import psutil

        t = psutil.Process(agent.process.pid).cpu_times()
        return float(t.user + t.system)
    except Exception:
        return None


def get_text(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body as text) of a GET; HTTP errors are returned, not raised."""
    code, body = http_get(url, timeout)
    return code, body.decode(errors="replace")


def add_import_shims(env: dict[str, str], scratch: Path, report: Report) -> list[str]:
    """The agent imports bcrypt and yaml (web config) at start; if this machine lacks them
    (no network to install them), stand-ins let the agent start without a web config."""
    missing = []
    for module in ("bcrypt", "yaml"):
        probe = run_cmd([sys.executable, "-c", f"import {module}"], 30, env)
        if probe["rc"] != 0:
            missing.append(module)
    if not missing:
        return missing
    shims = scratch / "shims"
    shims.mkdir(exist_ok=True)
    if "bcrypt" in missing:
        (shims / "bcrypt.py").write_text(
            "# gpu_node_check stand-in: bcrypt is not installed on this machine\n"
            "def gensalt(rounds=12, prefix=b'2b'):\n    return b'$2b$10$' + b'.' * 22\n"
            "def hashpw(password, salt):\n    return salt + b'.' * 31\n"
            "def checkpw(password, hashed):\n    return False\n")
    if "yaml" in missing:
        (shims / "yaml.py").write_text(
            "# gpu_node_check stand-in: PyYAML is not installed on this machine\n"
            "class YAMLError(Exception):\n    pass\n"
            "def safe_load(*args, **kwargs):\n"
            "    raise YAMLError('PyYAML is not installed (gpu_node_check stand-in)')\n")
    env["PYTHONPATH"] = str(shims) + os.pathsep + env["PYTHONPATH"]
    report.finding(f"the agent needs {', '.join(missing)} (imported at start by "
                   "gpumon.export.webconfig even without --web-config); not installed here, "
                   "so stand-in modules were put on the agent's PYTHONPATH")
    return missing



def section_endpoints(report: Report, result: dict[str, Any], agent: AgentProcess) -> None:
    """/healthz, /readyz and / answer."""
    for path in ("/healthz", "/readyz", "/"):
        try:
            code, body = get_text(agent.url + path, 5)
            result[path] = {"status": code, "body": body[:400]}
        except Exception as exc:
            result[path] = {"error": repr(exc)}
    report.check("agent.healthz", result["/healthz"].get("status") == 200, result["/healthz"])
    report.check("agent.readyz", result["/readyz"].get("status") == 200, result["/readyz"])



def section_replay(report: Report, result: dict[str, Any], env: dict[str, str]) -> None:
    """``gpumon classify`` replays the agent's recording."""
    rec = report.out / "recording.jsonl"
    proc = run_cmd([sys.executable, "-m", "gpumon.cli", "classify", str(rec), "--json"], 60, env)
    result["rc"] = proc["rc"]
    lines = proc["stdout"].splitlines()
    summary = None
    with contextlib.suppress(ValueError, IndexError):
        summary = json.loads(lines[-1]).get("summary")
    result["summary"] = summary
    result["stderr_tail"] = proc["stderr"][-2000:]
    result["recording_bytes"] = rec.stat().st_size if rec.exists() else None
    report.check("replay.classify_recording", proc["rc"] == 0 and summary is not None, summary)


def section_agent_stop(report: Report, result: dict[str, Any], agent: AgentProcess) -> None:
    """Stop the agent, read its log for errors, compress its recording."""
    result["rc"] = agent.stop()
    log = agent.log_path.read_text(errors="replace") if agent.log_path.exists() else ""
    problems = [ln for ln in log.splitlines()
                if re.search(r"Traceback|ERROR|CRITICAL|Exception", ln)]
    result["log_problem_lines"] = problems[:40]
    result["log_tail"] = log.splitlines()[-40:]
    report.check("agent.clean_exit", result["rc"] == 0, result["rc"])
    report.check("agent.log_without_errors", not problems, problems[:10])
    rec = report.out / "recording.jsonl"
    if rec.exists():  # compressed: it is the largest file to bring back
        with open(rec, "rb") as src, gzip.open(str(rec) + ".gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        result["recording"] = {"bytes": rec.stat().st_size,
                               "gz_bytes": Path(str(rec) + ".gz").stat().st_size}
        rec.unlink()

