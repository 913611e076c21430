"""TLS and basic auth for the HTTP endpoints, from a web config file in the format the
Prometheus exporters use (exporter-toolkit)::

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_ca_file: ca.crt            # optional: with client_auth_type, mutual TLS
      client_auth_type: RequireAndVerifyClientCert
      min_version: TLS12                # TLS10..TLS13
    basic_auth_users:
      prometheus: $2y$10$...            # bcrypt hashes only, never plain passwords
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ssl
import threading
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import bcrypt
import yaml

from gpumon.errors import GpumonError

_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3,
}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_KNOWN_TOP = {"tls_server_config", "basic_auth_users", "http_server_config"}
_CACHE_MAX = 256
BCRYPT_MAX_PASSWORD_BYTES = 72
FAILED_LOGINS_PER_MINUTE = 10
"""Password checks per client address and minute that may fail; beyond, a client's new
credentials are refused unchecked until its minute is over. bcrypt costs ~60 ms of CPU a
check: a flood of distinct wrong passwords took 187 % CPU and slowed valid scrapes."""
_CLIENTS_MAX = 4096


class WebConfigError(GpumonError, ValueError):
    """The web config file is unusable; the message says what and where."""


@dataclass
class WebConfig:
    """TLS context (or None for plain HTTP) and basic-auth users (empty: no auth)."""

    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    _verified: dict[bytes, bool] = field(default_factory=dict, repr=False)
    _failures: dict[str, tuple[float, int]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _hashing: threading.Lock = field(default_factory=threading.Lock, repr=False)
    throttled_total: int = 0
    checks_total: int = 0
    """bcrypt checks made (each ~60 ms of CPU)."""

    def authorized(self, header: str | None, client: str = "") -> bool:
        """Whether an Authorization header carries valid credentials (always, without users).

        bcrypt is deliberately slow (tens of ms): results are cached per exact credentials,
        as exporter-toolkit does, so frequent scrapes cost one hash comparison; one check
        runs at a time; and a ``client`` (address) whose checks failed
        ``FAILED_LOGINS_PER_MINUTE`` times in its current minute gets no more until it ends.
        """
        if not self.users:
            return True
        scheme, _, credentials = (header or "").strip().partition(" ")
        if scheme.lower() != "basic":  # auth schemes are case-insensitive (RFC 9110)
            return False
        try:
            decoded = base64.b64decode(credentials.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        user, sep, password = decoded.partition(b":")
        if not sep or len(password) > BCRYPT_MAX_PASSWORD_BYTES:
            # bcrypt reads at most 72 bytes (Python's refuses more, Go's fails the check):
            # no longer password can match, and no hash is spent on it.
            return False
        key = hashlib.sha256(decoded).digest()
        with self._lock:
            cached = self._verified.get(key)
            if cached is None and self._throttled(client, time.monotonic()):
                self.throttled_total += 1
                return False
        if cached is not None:
            return cached
        hashed = self.users.get(user.decode("utf-8", "replace"))
        with self._hashing:
            self.checks_total += 1
            # Same cost for unknown users, so timing does not tell which names exist.
            ok = bcrypt.checkpw(password, hashed if hashed is not None else _dummy_hash())
            ok = ok and hashed is not None
        with self._lock:
            if len(self._verified) >= _CACHE_MAX:
                # Refusals fill it; the few valid credentials stay.
                self._verified = {k: v for k, v in self._verified.items() if v}
            self._verified[key] = ok
            if not ok:
                self._failed(client, time.monotonic())
        return ok

    def _throttled(self, client: str, now: float) -> bool:
        started, failures = self._failures.get(client, (now, 0))
        return now - started < 60.0 and failures >= FAILED_LOGINS_PER_MINUTE

    def _failed(self, client: str, now: float) -> None:
        started, failures = self._failures.get(client, (now, 0))
        if now - started >= 60.0:
            started, failures = now, 0
        if client not in self._failures and len(self._failures) >= _CLIENTS_MAX:
            self._failures = {c: v for c, v in self._failures.items() if now - v[0] < 60.0}
            if len(self._failures) >= _CLIENTS_MAX:
                self._failures.clear()
        self._failures[client] = (started, failures + 1)


@cache
def _dummy_hash() -> bytes:
    # Made at the first unknown user, not at import: hashing costs ~60 ms of every start.
    return bcrypt.hashpw(b"gpumon", bcrypt.gensalt(rounds=10))


def load_web_config(path: Path) -> WebConfig:
    """Parse and check a web config file; raises WebConfigError with a clear reason."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise WebConfigError(f"cannot read web config {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise WebConfigError(f"web config {path} is not valid UTF-8 "
                             f"(byte {exc.start}: {exc.reason})") from exc
    except yaml.YAMLError as exc:
        raise WebConfigError(f"web config {path} is not valid YAML: {exc}") from exc
    if data is None:
        return WebConfig()
    if not isinstance(data, dict):
        raise WebConfigError(f"web config {path}: expected a mapping at the top level")
    unknown = sorted(set(data) - _KNOWN_TOP)
    if unknown:
        raise WebConfigError(f"web config {path}: unknown key(s) {', '.join(unknown)}")
    base = path.parent
    context = _tls(data.get("tls_server_config"), base, path)
    users = _users(data.get("basic_auth_users"), path)
    return WebConfig(ssl_context=context, users=users)


def _tls(section: Any, base: Path, path: Path) -> ssl.SSLContext | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise WebConfigError(f"web config {path}: tls_server_config must be a mapping")
    cert, key = section.get("cert_file"), section.get("key_file")
    if not cert or not key:
        raise WebConfigError(f"web config {path}: tls_server_config needs cert_file and key_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    version = section.get("min_version", "TLS12")
    if version not in _TLS_VERSIONS:
        raise WebConfigError(f"web config {path}: min_version {version!r}: choose one of "
                             f"{', '.join(_TLS_VERSIONS)}")
    context.minimum_version = _TLS_VERSIONS[version]
    try:
        context.load_cert_chain(base / cert, base / key)
    except (OSError, ssl.SSLError) as exc:
        raise WebConfigError(f"web config {path}: cannot load {cert} / {key}: {exc}") from exc
    auth = section.get("client_auth_type", "NoClientCert")
    if auth not in _CLIENT_AUTH:
        raise WebConfigError(f"web config {path}: client_auth_type {auth!r}: choose one of "
                             f"{', '.join(_CLIENT_AUTH)}")
    context.verify_mode = _CLIENT_AUTH[auth]
    ca = section.get("client_ca_file")
    if ca:
        try:
            context.load_verify_locations(base / ca)
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(f"web config {path}: cannot load client_ca_file {ca}: {exc}") \
                from exc
    elif auth == "RequireAndVerifyClientCert":
        raise WebConfigError(f"web config {path}: {auth} needs client_ca_file")
    return context


def _users(section: Any, path: Path) -> dict[str, bytes]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise WebConfigError(f"web config {path}: basic_auth_users must be a mapping")
    users: dict[str, bytes] = {}
    for name, hashed in section.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise WebConfigError(f"web config {path}: user {name!r}: expected a bcrypt hash "
                                 f"($2y$...), not a plain password")
        # Python's bcrypt reads $2y$ (Apache htpasswd) as the equivalent $2b$.
        users[str(name)] = ("$2b$" + hashed[4:]).encode()
        try:  # a damaged hash fails here, once, not in every request
            bcrypt.checkpw(b"", users[str(name)])
        except ValueError as exc:
            raise WebConfigError(f"web config {path}: user {name!r}: not a valid bcrypt "
                                 f"hash ({exc})") from None
    return users

