"""Who may ask the agent for a trace through its HTTP API (``POST /api/v1/traces``): the agent
serves on every address without auth by default, as exporters serve ``/metrics``, so a request
that acts is refused from anywhere but the node itself unless auth is configured; from the
node, only root, the agent's user or the job's user may ask (the connection's owner, read from
the kernel's socket table). A real agent on 0.0.0.0, asked from this machine's own
non-loopback address (the first IPv4 address of an interface that is up, not 127/8), from
127.0.0.1, with and without basic auth, and as another user."""

from __future__ import annotations

import base64
import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import bcrypt
import psutil
import pytest

from gpumon.client import StepMonitor
from gpumon.testing import wait_for
from gpumon.testing.agent import library_agent

PASSWORD = "s3cret"
NOBODY = 65534


def own_address() -> str | None:
    """A non-loopback IPv4 address of this machine whose interface is up."""
    stats = psutil.net_if_stats()
    for name, addresses in psutil.net_if_addrs().items():
        if not stats.get(name) or not stats[name].isup:
            continue
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return None


def post(port: int, body: dict[str, Any], source: str = "127.0.0.1", host: str = "127.0.0.1",
         user: str | None = None) -> tuple[int, dict[str, Any]]:
    """POST from ``source`` (the client socket bound there) to ``host:port``."""
    request = urllib.request.Request(f"http://{host}:{port}/api/v1/traces", method="POST",
                                     data=json.dumps(body).encode())
    if user is not None:
        request.add_header("Authorization",
                           "Basic " + base64.b64encode(f"{user}:{PASSWORD}".encode()).decode())
    handler = _SourceHandler(source)
    try:
        with urllib.request.build_opener(handler).open(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        text = exc.read()
        return exc.code, json.loads(text) if text.startswith(b"{") else {"error": text.decode()}


class _SourceHandler(urllib.request.HTTPHandler):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source

    def http_open(self, req: Any) -> Any:
        import http.client

        source = self.source

        class Connection(http.client.HTTPConnection):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs["source_address"] = (source, 0)
                super().__init__(*args, **kwargs)

        return self.do_open(Connection, req)


def test_an_acting_request_from_another_address_needs_auth(tmp_path: Path) -> None:
    address = own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to ask from")
    with library_agent(tmp_path / "s.sock", address="0.0.0.0", trace_dir=str(tmp_path / "t")) as agent:
        remote = post(agent.port, {"run": "r", "rank": 0}, source=address, host=address)
        local = post(agent.port, {"run": "r", "rank": 0})
        with urllib.request.urlopen(f"http://{address}:{agent.port}/api/v1/traces", timeout=5) as r:
            listing = json.loads(r.read())
    assert remote[0] == 403 and "auth" in remote[1]["error"], remote
    assert local == (404, {"error": "rank 0 of run 'r' does not report to this agent"}), local
    assert listing["requests"] == [] and listing["directory"] == str(tmp_path / "t")


def test_with_auth_an_authenticated_request_from_another_address_is_taken(tmp_path: Path) -> None:
    address = own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to ask from")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  ops: {hashed}\n")
    with library_agent(tmp_path / "s.sock", address="0.0.0.0", web_config=str(web),
                       trace_dir=str(tmp_path / "t")) as agent:
        anonymous = post(agent.port, {"run": "r", "rank": 0}, source=address, host=address)
        authenticated = post(agent.port, {"run": "r", "rank": 0}, source=address, host=address,
                             user="ops")
    assert anonymous[0] == 401
    assert authenticated[0] == 404, authenticated  # past the gate: the rank is unknown


@pytest.mark.skipif(os.getuid() != 0, reason="asking as another user needs root to become one")
def test_a_local_user_who_is_not_the_jobs_may_not_ask(tmp_path: Path) -> None:
    with library_agent(tmp_path / "s.sock", trace_dir=str(tmp_path / "t")) as agent:
        monitor = StepMonitor("mine", socket_path=str(tmp_path / "s.sock"), rank=0, world=1)
        with monitor.step():
            pass
        monitor.flush()
        wait_for(lambda: any(t.run == "mine" for t in agent.rank_store.ranks()), what="the rank")
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the request comes from a process of another user
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                os.write(write, json.dumps(post(agent.port, {"run": "mine", "rank": 0})).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as answer:
            code, document = json.loads(answer.read())
        os.waitpid(child, 0)
        monitor.close()
    assert code == 403 and f"uid {NOBODY} may not trace rank 0 of run 'mine'" in document["error"], document
