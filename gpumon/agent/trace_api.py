"""The agent's trace API (``/api/v1/traces``): who may ask a rank for a trace, and from where.

Asking acts on a job, so without auth only the node itself may ask, and only root, the agent's
user or the job's user (the kernel's socket table names who is at the other end).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from gpumon.agent.traces import Api, TraceDesk, TraceError


def trace_api(desk: Callable[[], TraceDesk | None]) -> Api:
    """The HTTP API's ``/api/v1/traces`` (for ``export.server``): ``GET`` lists, ``GET
    /api/v1/traces/<id>`` shows one, ``POST`` with ``{"run", "rank" | "all_ranks", "steps"}``
    asks. Asking acts on a job: without the agent's auth it is taken only from this node, and
    then only from root, the agent's user or the job's (the connection's owner, from the
    kernel's socket table)."""

    def api(method: str, target: str, body: bytes, client: Any, local: Any,
            authenticated: bool) -> tuple[int, dict[str, Any]]:
        traces = desk()
        if traces is None:
            return 503, {"error": "traces need the ingest socket, which is not running"}
        path = urlsplit(target).path.rstrip("/")
        if method == "GET":
            if path == "/api/v1/traces":
                return 200, traces.listing()
            trace = traces.get(path.rsplit("/", 1)[-1])
            return (404, {"error": "no such trace"}) if trace is None else (200, trace.public())
        if method != "POST" or path != "/api/v1/traces":
            return 405, {"error": "POST /api/v1/traces asks for a trace"}
        requester: int | None = None
        if not authenticated:
            if not _loopback(client[0]):
                return 403, {"error": "asking for a trace from another host needs the agent's "
                                      "auth (--web-config with basic_auth_users)"}
            requester = tcp_peer_uid(client, local)
            if requester is None:
                return 403, {"error": "cannot tell which local user asks"}
        try:
            request = json.loads(body or b"{}")
            run = str(request["run"])
            rank = None if request.get("all_ranks") else int(request["rank"])
            steps = None if request.get("steps") is None else int(request["steps"])
        except (ValueError, KeyError, TypeError):
            return 400, {"error": 'expected {"run": RUN, "rank": N | "all_ranks": true, "steps": K}'}
        try:
            made = traces.request(run, rank, steps, requester_uid=requester)
        except TraceError as exc:
            return exc.code, {"error": str(exc)}
        return 202, {"traces": [t.public() for t in made]}

    return api


def _loopback(address: str) -> bool:
    import ipaddress

    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool((mapped or ip).is_loopback)


def tcp_peer_uid(client: Any, local: Any) -> int | None:
    """The uid owning the local TCP socket at ``client`` connected to ``local`` (both this
    node's addresses), from the kernel's ``/proc/net/tcp`` and ``tcp6`` tables."""
    import ipaddress

    want_local = (ipaddress.ip_address(client[0].split("%", 1)[0]), int(client[1]))
    want_remote = (ipaddress.ip_address(local[0].split("%", 1)[0]), int(local[1]))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 8:
                continue
            if _endpoint(parts[1]) == want_local and _endpoint(parts[2]) == want_remote:
                return int(parts[7])
    return None


def _endpoint(text: str) -> tuple[Any, int]:
    """An address of /proc/net/tcp: the IP in the kernel's byte order (words of four
    bytes, each little-endian on x86), then the port; IPv4-mapped IPv6 as IPv4."""
    import ipaddress

    hex_ip, hex_port = text.split(":")
    raw = bytes.fromhex(hex_ip)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    ip: Any = ipaddress.ip_address(raw)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip), int(hex_port, 16)
