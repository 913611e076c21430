"""HTTP endpoints: /metrics, /healthz, /readyz and /api/v1/snapshot."""

from __future__ import annotations

import json
import logging
import selectors
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpumon.export.exposition import render
from gpumon.export.webconfig import WebConfig

log = logging.getLogger(__name__)

CONNECTION_TIMEOUT_S = 10.0


class ServeError(RuntimeError):
    """The HTTP server cannot start (port in use, bad address, no permission)."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    web: WebConfig = WebConfig()

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        return self.web.ssl_context

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
        super().finish_request(request, client_address)


class MetricsServer:
    """Serves the registry and the agent's JSON views on one port, on its own threads."""

    def __init__(self, address: str, port: int, registry: CollectorRegistry,
                 readiness: Callable[[], tuple[bool, dict[str, Any]]],
                 snapshot: Callable[[], dict[str, Any]], web: WebConfig | None = None) -> None:
        web = web or WebConfig()
        handler = _make_handler(registry, readiness, snapshot)
        try:
            self._server = _Server((address, port), handler)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ServeError(f"cannot listen on {address}:{port}: {reason}") from exc
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="gpumon-http", daemon=True)
        self.set_web(web)

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
        self._server.server_close()
        self._wake_r.close()
        self._wake_w.close()


def _make_handler(registry: CollectorRegistry,
                  readiness: Callable[[], tuple[bool, dict[str, Any]]],
                  snapshot: Callable[[], dict[str, Any]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gpumon"
        timeout = CONNECTION_TIMEOUT_S  # an idle or trickling client loses its thread

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            # Liveness says nothing worth protecting, and probes rarely carry credentials.
            web: WebConfig = self.server.web  # type: ignore[attr-defined]
            if path != "/healthz" and not web.authorized(self.headers.get("Authorization")):
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="gpumon"')
                self.send_header("Content-Length", "13")
                self.end_headers()
                self.wfile.write(b"unauthorized\n")
                return
            try:
                if path == "/metrics":
                    # Always the text format: the metric contract has a counter and a gauge
                    # sharing a stem (gpumon_step_bottleneck_total / gpumon_step_bottleneck),
                    # which OpenMetrics cannot express and the text format can.
                    self._send(200, CONTENT_TYPE_LATEST, render(registry.collect()))
                elif path == "/healthz":
                    self._send(200, "text/plain; charset=utf-8", b"ok\n")
                elif path == "/readyz":
                    ready, body = readiness()
                    self._json(200 if ready else 503, body)
                elif path == "/api/v1/snapshot":
                    self._json(200, snapshot())
                elif path == "/":
                    self._send(200, "text/html; charset=utf-8", _INDEX)
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found\n")
            except Exception:  # a bug in one view must not kill the server thread
                log.exception("error serving %s", path)
                self._send(500, "text/plain; charset=utf-8", b"internal error\n")

        def _json(self, code: int, body: dict[str, Any]) -> None:
            self._send(code, "application/json", json.dumps(body).encode())

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


_INDEX = b"""<html><head><title>gpumon</title></head><body><h1>gpumon</h1>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/readyz">/readyz</a></li>
<li><a href="/api/v1/snapshot">/api/v1/snapshot</a></li></ul></body></html>
"""
