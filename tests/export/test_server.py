"""The HTTP server's bounds and manners: a cap on connections, deadlines for slow clients,
a bound on failed logins, gzip, HEAD, IPv6, and the text format for every scraper."""

from __future__ import annotations

import base64
import gzip
import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE,
)
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from gpumon.export.connections import ConnectionGate
from gpumon.export.server import MetricsServer
from gpumon.export.webconfig import FAILED_LOGINS_PER_MINUTE, WebConfig
from tests.helpers import http_get, parse_metrics, start_agent, value, wait_for

PASSWORD = b"right-one"


def registry_with_series(n: int = 200) -> CollectorRegistry:
    registry = CollectorRegistry()
    gauge = Gauge("demo_value", "A value per thing.", ["thing"], registry=registry)
    for i in range(n):
        gauge.labels(f"thing-{i}").set(i)
    return registry


Serve = Callable[..., MetricsServer]


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Start a server on ``address`` (and port 0) with these MetricsServer arguments."""
    servers: list[MetricsServer] = []

    def start(address: str = "127.0.0.1", **kwargs: Any) -> MetricsServer:
        server = MetricsServer(address, 0, registry_with_series(),
                               lambda: (True, {"status": "ok"}), lambda: {}, **kwargs)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def request(host: str, port: int, method: str = "GET", path: str = "/metrics",
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def connection_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "gpumon-http-conn")


def test_idle_connections_are_capped_and_a_scrape_still_gets_in(serve: Serve) -> None:
    server = serve()
    before = connection_threads()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(300)]
    try:
        wait_for(lambda: value(parse_metrics(
            server_metrics(server)), "gpumon_http_connections_refused_total",
            reason="replaced_waiting") >= 300 - 64 - 1, what="the excess replaced")
        assert connection_threads() - before <= 64 + 8  # the cap, and a few finishing
        status, _, body = request("127.0.0.1", server.port)
        assert status == 200 and b"demo_value" in body
    finally:
        for s in idle:
            s.close()


def server_metrics(server: MetricsServer) -> str:
    status, _, body = request("127.0.0.1", server.port)
    assert status == 200
    return body.decode()


def test_a_client_trickling_its_request_is_cut_at_the_deadline(serve: Serve) -> None:
    server = serve(gate=ConnectionGate(request_deadline_s=1.0))
    slow = socket.create_connection(("127.0.0.1", server.port))
    slow.sendall(b"GET /metrics HTTP/1.0\r\n")
    started = time.monotonic()
    closed = False
    while time.monotonic() - started < 8.0:  # a header line every 0.3 s, forever
        try:
            slow.sendall(b"X-Slow: 1\r\n")
            slow.settimeout(0.3)
            if slow.recv(1) == b"":
                closed = True
                break
        except TimeoutError:
            continue
        except OSError:
            closed = True
            break
    slow.close()
    assert closed and time.monotonic() - started < 4.0
    assert value(parse_metrics(server_metrics(server)), "gpumon_http_connections_refused_total",
                 reason="slow_request") == 1


def basic(password: bytes, user: bytes = b"prometheus") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(user + b":" + password).decode()}


def test_a_flood_of_wrong_passwords_costs_a_bounded_number_of_checks(serve: Serve) -> None:
    web = WebConfig(users={"prometheus": bcrypt.hashpw(PASSWORD, bcrypt.gensalt(rounds=4))})
    server = serve("::", web=web)
    assert request("127.0.0.1", server.port, headers=basic(PASSWORD))[0] == 200  # now cached
    for i in range(60):  # distinct wrong passwords from one address
        assert request("127.0.0.1", server.port, headers=basic(b"guess-%d" % i))[0] == 401
    assert web.checks_total == 1 + FAILED_LOGINS_PER_MINUTE
    assert web.throttled_total == 60 - FAILED_LOGINS_PER_MINUTE
    # The scraper whose credentials are known, and a new client elsewhere, still get in.
    assert request("127.0.0.1", server.port, headers=basic(PASSWORD))[0] == 200
    status, _, body = request("::1", server.port, headers={
        **basic(PASSWORD), "Accept-Encoding": "identity"})
    assert status == 200
    assert value(parse_metrics(body.decode()), "gpumon_http_auth_throttled_total") == 50


def test_gzip_when_accepted(serve: Serve) -> None:
    server = serve()
    status, plain_headers, plain = request("127.0.0.1", server.port)
    assert status == 200 and "content-encoding" not in plain_headers
    status, headers, packed = request("127.0.0.1", server.port,
                                      headers={"Accept-Encoding": "gzip, deflate"})
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert headers["vary"] == "Accept-Encoding"
    assert int(headers["content-length"]) == len(packed) < len(plain) / 3
    assert gzip.decompress(packed).split(b"\n# HELP gpumon_http")[0] == \
        plain.split(b"\n# HELP gpumon_http")[0]
    refused = request("127.0.0.1", server.port, headers={"Accept-Encoding": "gzip;q=0"})
    assert "content-encoding" not in refused[1]


@pytest.mark.parametrize("path", ["/healthz", "/metrics", "/readyz", "/nope"])
def test_head_answers_like_get_without_the_body(serve: Serve, path: str) -> None:
    server = serve()
    get_status, get_headers, get_body = request("127.0.0.1", server.port, "GET", path)
    status, headers, body = request("127.0.0.1", server.port, "HEAD", path)
    assert (status, body) == (get_status, b"")
    assert headers["content-type"] == get_headers["content-type"]
    if path != "/metrics":  # the metrics' own counters move between the two requests
        assert headers["content-length"] == get_headers["content-length"] == str(len(get_body))


def test_ipv6_addresses(serve: Serve) -> None:
    loopback = serve("::1")
    assert request("::1", loopback.port, path="/healthz")[0] == 200
    with pytest.raises(OSError):
        request("127.0.0.1", loopback.port, path="/healthz")
    everywhere = serve("::")
    for host in ("::1", "127.0.0.1"):
        assert request(host, everywhere.port, path="/healthz")[0] == 200


def test_an_openmetrics_scraper_gets_openmetrics(serve: Serve) -> None:
    server = serve()
    status, headers, body = request("127.0.0.1", server.port, headers={
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
    assert status == 200
    assert headers["content-type"] == OPENMETRICS_CONTENT_TYPE
    assert body.endswith(b"# EOF\n")
    assert {f.name for f in openmetrics_families(body.decode())} >= {"demo_value"}
    status, headers, body = request("127.0.0.1", server.port, headers={"Accept": "text/plain"})
    assert headers["content-type"] == CONTENT_TYPE_LATEST and b"# EOF" not in body
    assert {f.name for f in text_string_to_metric_families(body.decode())} >= {"demo_value"}


def test_the_agent_serves_on_ipv6(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, "--simulate", "1", "--address", "::")  # a later flag wins
    try:
        assert http_get(f"http://[::1]:{agent.port}/metrics")[0] == 200
        assert http_get(f"http://127.0.0.1:{agent.port}/healthz")[0] == 200
        assert f"serving on http://[::]:{agent.port}/metrics" in agent.log()
    finally:
        assert agent.stop() == 0, agent.log()
