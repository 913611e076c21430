"""Loopback plumbing that tests and benchmarks share: a free port, a GET, polling."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port nobody listens on right now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; HTTP errors are returned, not raised (a 503 from /readyz is an
    answer worth reading), while a refused or timed-out connection raises OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


def wait_for(predicate: Callable[[], T], timeout: float = 15.0, interval: float = 0.1,
             what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy, and return that; after ``timeout``
    raise AssertionError with the last result. OSError and ValueError inside the predicate
    (a service still starting, half a JSON body) count as "not yet"."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
        except (OSError, ValueError) as exc:
            last = exc
        else:
            if result:
                return result
            last = result
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last result: {last!r}")
