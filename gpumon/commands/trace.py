"""``gpumon trace``: ask the agent for a profiler trace of a rank's next steps, or list traces.

It speaks to the agent's HTTP API (``/api/v1/traces``). Credentials for an agent with auth
come in the URL (``http://user:password@host:port``). Without auth the agent takes a request
only from its own node, from root, its own user or the job's.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gpumon.errors import GpumonError

WAIT_TIMEOUT_S = 180.0
POLL_S = 0.25


class TraceCommandError(GpumonError, RuntimeError):
    """What went wrong, for the user; ``exit_code`` 1 (the agent said no) or 2 (usage)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _call(url: str, path: str, body: dict[str, Any] | None = None,
          timeout_s: float = 10.0) -> tuple[int, dict[str, Any]]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TraceCommandError(f"--url {url!r}: expected the agent's address, "
                                "like http://127.0.0.1:9403", 2)
    netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    if parts.port:
        netloc += f":{parts.port}"
    target = urllib.parse.urlunsplit((parts.scheme, netloc, path, "", ""))
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(target, data=data, method="GET" if data is None else "POST")
    request.add_header("Content-Type", "application/json")
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            document = json.loads(exc.read() or b"{}")
        except ValueError:
            document = {"error": exc.reason}
        return exc.code, document
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise TraceCommandError(f"no agent answers at {url}: {reason}") from exc
    except ValueError as exc:
        raise TraceCommandError(f"{url} did not answer with JSON: {exc}") from exc


def request_traces(url: str, run: str, rank: int | None, steps: int, wait: bool,
                   wait_timeout_s: float = WAIT_TIMEOUT_S) -> list[str]:
    """Ask for the traces; the lines to print (with ``wait``, each trace's path once written).
    Raises ``TraceCommandError`` when the agent refuses or a trace fails."""
    body: dict[str, Any] = {"run": run, "steps": steps}
    if rank is None:
        body["all_ranks"] = True
    else:
        body["rank"] = rank
    code, document = _call(url, "/api/v1/traces", body)
    if code != 202:
        raise TraceCommandError(f"the agent refused (HTTP {code}): {document.get('error', document)}")
    traces = document.get("traces", [])
    if not wait:
        return [f"rank {t['rank']}: trace {t['id']} {t['state']}" for t in traces]
    lines: list[str] = []
    failures: list[str] = []
    deadline = time.monotonic() + wait_timeout_s
    pending = {t["id"]: t for t in traces}
    while pending:
        for ident in list(pending):
            code, trace = _call(url, f"/api/v1/traces/{ident}")
            if code != 200:
                failures.append(f"trace {ident}: {trace.get('error', code)}")
                del pending[ident]
            elif trace["state"] == "done":
                lines.append(trace["path"])
                del pending[ident]
            elif trace["state"] == "failed":
                failures.append(f"rank {trace['rank']}: {trace.get('reason')}: {trace.get('message')}")
                del pending[ident]
        if pending and time.monotonic() > deadline:
            failures.extend(f"rank {t['rank']}: no trace after {wait_timeout_s:g} s"
                            for t in pending.values())
            break
        if pending:
            time.sleep(POLL_S)
    if failures:
        raise TraceCommandError("\n".join(lines + failures))
    return lines


def list_traces(url: str, run: str | None) -> list[str]:
    """One line per trace file on the agent's node (newest first), then requests that failed."""
    code, document = _call(url, "/api/v1/traces")
    if code != 200:
        raise TraceCommandError(f"the agent refused (HTTP {code}): {document.get('error', document)}")
    lines = []
    for f in document.get("files", []):
        if run is None or f["run"] == run.replace("/", "_").replace(":", "_"):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f["mtime"]))
            lines.append(f"{stamp}  {f['run']}  rank {f['rank']}  step {f['first_step']}  "
                         f"{f['bytes']} B  {f['path']}")
    for r in document.get("requests", []):
        if r["state"] == "failed" and (run is None or r["run"] == run):
            lines.append(f"failed  {r['run']}  rank {r['rank']}  {r['trigger']}: {r['reason']}: "
                         f"{r['message']}")
    return lines or [f"no traces in {document.get('directory')}"]
