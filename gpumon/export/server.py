"""HTTP endpoints: /metrics, /healthz, /readyz and /api/v1/snapshot.

Bounded (``connections``: a cap on connections, deadlines for slow ones; ``webconfig``: a
bound on what failed logins cost), IPv4 or IPv6, ``HEAD`` as ``GET`` without the body, and
gzip for clients that accept it (Prometheus does: 427 KB of text at 8 GPUs × 64 ranks is
34 KB gzipped).

/metrics answers in OpenMetrics 1.0 to a scraper whose ``Accept`` prefers it (Prometheus
asks for it first), and in the Prometheus text format (0.0.4) otherwise; the same families
and cached series serve both (``exposition``).
"""

from __future__ import annotations

import gzip
import json
import logging
import selectors
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE,
)

from gpumon.errors import GpumonError
from gpumon.export.connections import Connection, ConnectionGate
from gpumon.export.exposition import CounterFamily, render, render_openmetrics
from gpumon.export.webconfig import WebConfig

log = logging.getLogger(__name__)

CONNECTION_TIMEOUT_S = 10.0
GZIP_MIN_BYTES = 1024  # below this, compressing saves less than it costs
GZIP_LEVEL = 1
"""The fastest level: at 8 GPUs x 64 ranks it compresses the 427 KB scrape to 34 KB in half
the CPU of level 6 (30 KB), and that CPU is the scrape's latency (benchmarks/RESULTS.md,
"Causes and fixes", Scrape)."""


class ServeError(GpumonError, RuntimeError):
    """The HTTP server cannot start (port in use, bad address, no permission)."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    web: WebConfig = WebConfig()

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 gate: ConnectionGate) -> None:
        self.gate = gate
        self._current = threading.local()  # the Connection each connection thread serves
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            # "::" serves IPv4 too (as "0.0.0.0" would), whatever the node's bindv6only says.
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY,
                                   0 if self.server_address[0] == "::" else 1)
        super().server_bind()

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        return self.web.ssl_context

    def process_request(self, request: Any, client_address: Any) -> None:
        connection = self.gate.admit(request)
        if connection is None:
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self._serve_connection, name="gpumon-http-conn",
                                  args=(request, client_address, connection), daemon=True)
        thread.start()

    def _serve_connection(self, request: Any, client_address: Any,
                          connection: Connection) -> None:
        self._current.connection = connection
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.gate.done(connection)  # before the close: the reaper must never see it reused
            self.shutdown_request(request)

    def request_read(self) -> None:
        """Called by the handler once the request line and headers are in."""
        self.gate.requested(self._current.connection)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # TLS handshakes happen here, on the connection's own thread, so a slow or
        # malicious client can never hold up accept() for everyone else.
        if self.ssl_context is not None:
            request.settimeout(CONNECTION_TIMEOUT_S)
            try:
                request = self.ssl_context.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError) as exc:
                log.debug("TLS handshake with %s failed: %s", client_address, exc)
                return
            self._current.connection.sock = request  # the reaper shuts down the TLS socket
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("connection from %s failed", client_address, exc_info=True)


class _ServerCollector:
    """The server's own counters: connections refused or cut, logins not even checked."""

    def __init__(self, gate: ConnectionGate, server: _Server) -> None:
        self._gate = gate
        self._server = server

    def collect(self) -> Iterator[Metric]:
        refused = CounterFamily(
            "gpumon_http_connections_refused",
            "HTTP connections refused or cut: too_many_connections, replaced_waiting (the "
            "oldest connection without a request, to make room), slow_request, slow_response.",
            labels=["reason"])
        for reason, count in sorted(self._gate.refused_total.items()):
            refused.add_metric([reason], float(count))
        throttled = CounterFamily(
            "gpumon_http_auth_throttled",
            "Basic-auth attempts refused without checking the password, their client having "
            "failed too often in the last minute.", labels=[])
        throttled.add_metric([], float(self._server.web.throttled_total))
        yield refused
        yield throttled

    def describe(self) -> list[Metric]:
        """The families, so the registry knows their names (counting them is no I/O)."""
        return list(self.collect())


class MetricsServer:
    """Serves the registry and the agent's JSON views on one port, on its own threads."""

    def __init__(self, address: str, port: int, registry: CollectorRegistry,
                 readiness: Callable[[], tuple[bool, dict[str, Any]]],
                 snapshot: Callable[[], dict[str, Any]], web: WebConfig | None = None,
                 gate: ConnectionGate | None = None, api: Api | None = None) -> None:
        web = web or WebConfig()
        handler = _make_handler(registry, readiness, snapshot, api)
        self._gate = gate or ConnectionGate()
        try:
            self._server = _Server((address, port), handler, self._gate)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ServeError(f"cannot listen on {address}:{port}: {reason}") from exc
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="gpumon-http", daemon=True)
        self.set_web(web)
        registry.register(_ServerCollector(self._gate, self._server))

    def set_web(self, web: WebConfig) -> None:
        """Swap TLS certificates and users (SIGHUP); new connections use them at once."""
        self._server.web = web
        self.scheme = "https" if web.ssl_context else "http"

    @property
    def port(self) -> int:
        """The bound port (useful when 0 was asked for)."""
        return int(self._server.server_address[1])

    def start(self) -> None:
        """Start serving in the background."""
        self._gate.start()
        self._thread.start()

    def _serve(self) -> None:
        # serve_forever() wakes every poll_interval to look for shutdown(); this sleeps in
        # select() with no timeout until a connection comes or stop() writes to the pair.
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = selector.select()
                if any(key.fileobj is self._wake_r for key, _ in ready):
                    return
                # accept, then a thread per request: the step serve_forever() takes itself
                self._server._handle_request_noblock()  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Stop serving (if started) and close the socket."""
        if self._thread.is_alive():
            self._wake_w.send(b"\0")
            self._thread.join()
        self._gate.stop()
        self._server.server_close()
        self._wake_r.close()
        self._wake_w.close()


Api = Callable[[str, str, bytes, Any, Any, bool], tuple[int, dict[str, Any]]]
"""``/api/v1/traces``: ``api(method, target, body, client address, local address,
authenticated)`` -> (status, JSON document); it decides what an unauthenticated request may do."""
MAX_API_BODY = 4096


def _make_handler(registry: CollectorRegistry,
                  readiness: Callable[[], tuple[bool, dict[str, Any]]],
                  snapshot: Callable[[], dict[str, Any]],
                  api: Api | None = None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gpumon"
        timeout = CONNECTION_TIMEOUT_S  # an idle or trickling client loses its thread

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._answer(with_body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            # Load balancers probe /healthz with HEAD: the same status and headers, no body.
            self._answer(with_body=False)

        def do_POST(self) -> None:  # noqa: N802
            self._answer(with_body=True, method="POST")

        def _answer(self, with_body: bool, method: str = "GET") -> None:
            server: _Server = self.server  # type: ignore[assignment]
            server.request_read()
            path = self.path.split("?", 1)[0]
            # Liveness says nothing worth protecting, and probes rarely carry credentials.
            if path != "/healthz" and not server.web.authorized(
                    self.headers.get("Authorization"), self.client_address[0]):
                self._send(401, "text/plain; charset=utf-8", b"unauthorized\n", with_body,
                           {"WWW-Authenticate": 'Basic realm="gpumon"'})
                return
            try:
                if api is not None and path.startswith("/api/v1/traces"):
                    code, content_type, body = self._api(api, method, bool(server.web.users))
                elif method != "GET":
                    code, content_type, body = 405, "text/plain; charset=utf-8", b"method not allowed\n"
                else:
                    code, content_type, body = self._view(path)
            except Exception:  # a bug in one view must not kill the server thread
                log.exception("error serving %s", path)
                code, content_type, body = 500, "text/plain; charset=utf-8", b"internal error\n"
            self._send(code, content_type, body, with_body)

        def _view(self, path: str) -> tuple[int, str, bytes]:
            if path == "/metrics":
                if wants_openmetrics(self.headers.get("Accept", "")):
                    return 200, OPENMETRICS_CONTENT_TYPE, render_openmetrics(registry.collect())
                return 200, CONTENT_TYPE_LATEST, render(registry.collect())
            if path == "/healthz":
                return 200, "text/plain; charset=utf-8", b"ok\n"
            if path == "/readyz":
                ready, body = readiness()
                return 200 if ready else 503, "application/json", json.dumps(body).encode()
            if path == "/api/v1/snapshot":
                return 200, "application/json", json.dumps(snapshot()).encode()
            if path == "/":
                return 200, "text/html; charset=utf-8", _INDEX
            return 404, "text/plain; charset=utf-8", b"not found\n"

        def _api(self, api: Api, method: str, authenticated: bool) -> tuple[int, str, bytes]:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 <= length <= MAX_API_BODY:
                return 413, "application/json", b'{"error": "request too large"}'
            body = self.rfile.read(length) if length else b""
            code, document = api(method, self.path, body, self.client_address,
                                 self.connection.getsockname(), authenticated)
            return code, "application/json", json.dumps(document).encode()

        def _send(self, code: int, content_type: str, body: bytes, with_body: bool,
                  headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            if len(body) >= GZIP_MIN_BYTES:
                self.send_header("Vary", "Accept-Encoding")
                if _accepts_gzip(self.headers.get("Accept-Encoding", "")):
                    body = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
                    self.send_header("Content-Encoding", "gzip")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


def wants_openmetrics(accept: str) -> bool:
    """Whether an Accept header prefers OpenMetrics 1.0 to the text format (ties go to
    OpenMetrics; no header, or one naming neither, gets the text format)."""
    openmetrics = text = 0.0
    for item in accept.split(","):
        media, *params = (part.strip().lower() for part in item.split(";"))
        quality, version = 1.0, None
        for param in params:
            key, _, val = param.partition("=")
            if key.strip() == "q":
                quality = _q(val.strip())
            elif key.strip() == "version":
                version = val.strip()
        if media == "application/openmetrics-text" and version in (None, "1.0.0"):
            openmetrics = max(openmetrics, quality)
        elif media in ("text/plain", "text/*", "*/*"):
            text = max(text, quality)
    return openmetrics > 0 and openmetrics >= text


def _accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header allows gzip (``gzip;q=0`` refuses it)."""
    for item in accept_encoding.split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() in ("gzip", "*"):
            quality = params.strip().lower()
            return not (quality.startswith("q=") and _q(quality[2:]) == 0.0)
    return False


def _q(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 1.0


_INDEX = b"""<html><head><title>gpumon</title></head><body><h1>gpumon</h1>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/readyz">/readyz</a></li>
<li><a href="/api/v1/snapshot">/api/v1/snapshot</a></li></ul></body></html>
"""
