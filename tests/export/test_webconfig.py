"""TLS and basic auth on the HTTP endpoints, from an exporter-toolkit style web config."""

from __future__ import annotations

import base64
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
from prometheus_client import CollectorRegistry

from gpumon.export.server import MetricsServer
from gpumon.export.webconfig import WebConfigError, load_web_config
from tests.helpers import start_prometheus, wait_for

PASSWORD = "s3cret-scrape"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed certificate for 127.0.0.1 (the test's own CA)."""
    directory = tmp_path_factory.mktemp("certs")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(directory / "server.key"), "-out", str(directory / "server.crt"),
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True)
    return directory


def web_config(directory: Path, tls: bool = True, users: bool = True) -> Path:
    lines = []
    if tls:
        lines += ["tls_server_config:", "  cert_file: server.crt", "  key_file: server.key"]
    if users:
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=6)).decode()
        lines += ["basic_auth_users:", f"  prometheus: {hashed.replace('$2b$', '$2y$', 1)}"]
    path = directory / f"web-{tls}-{users}.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def server(certs: Path) -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    web = load_web_config(web_config(certs))
    metrics = MetricsServer("127.0.0.1", 0, registry, lambda: (True, {"status": "ok"}),
                            lambda: {}, web)
    metrics.start()
    yield metrics
    metrics.stop()


def get(url: str, certs: Path, user: str | None = None, password: str | None = None) -> int:
    context = ssl.create_default_context(cafile=str(certs / "server.crt"))
    request = urllib.request.Request(url)
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, context=context, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_tls_and_credentials(server: MetricsServer, certs: Path) -> None:
    url = f"https://127.0.0.1:{server.port}"
    assert server.scheme == "https"
    assert get(url + "/metrics", certs, "prometheus", PASSWORD) == 200
    assert get(url + "/metrics", certs, "prometheus", "wrong") == 401
    assert get(url + "/metrics", certs, "someone", PASSWORD) == 401
    assert get(url + "/metrics", certs) == 401
    assert get(url + "/api/v1/snapshot", certs) == 401
    assert get(url + "/healthz", certs) == 200  # liveness stays open for probes
    with pytest.raises(OSError):  # plain HTTP on a TLS port gets nowhere (reset or refused)
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5)


def test_real_prometheus_scrapes_over_tls_with_credentials(
        server: MetricsServer, certs: Path, tmp_path: Path) -> None:
    auth = {"scheme": "https", "tls_config": {"ca_file": str(certs / "server.crt")}}
    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    good = start_prometheus(tmp_path / "good", [f"127.0.0.1:{server.port}"], scrape_extra={
        **auth, "basic_auth": {"username": "prometheus", "password": PASSWORD}})
    bad = start_prometheus(tmp_path / "bad", [f"127.0.0.1:{server.port}"], scrape_extra={
        **auth, "basic_auth": {"username": "prometheus", "password": "nope"}})
    try:
        up = wait_for(lambda: good.query('up{job="gpumon"}'), timeout=30)
        wait_for(lambda: good.query('up{job="gpumon"} == 1'), timeout=30, what="up == 1")
        assert up
        down = wait_for(lambda: bad.query('up{job="gpumon"}'), timeout=30)
        assert down[0]["value"][1] == "0"
    finally:
        good.stop()
        bad.stop()


@pytest.mark.parametrize(("text", "message"), [
    ("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n", "cannot load"),
    ("basic_auth_users:\n  alice: hunter2\n", "expected a bcrypt hash"),
    ("tls_server_config:\n  cert_file: a\n", "needs cert_file and key_file"),
    ("basic_auth: {}\n", "unknown key(s) basic_auth"),
    ("- a\n- b\n", "expected a mapping"),
    ("tls_server_config: [\n", "not valid YAML"),
])
def test_bad_web_configs_are_clear(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "web.yml"
    path.write_text(text)
    with pytest.raises(WebConfigError) as excinfo:
        load_web_config(path)
    assert message in str(excinfo.value)


@pytest.fixture
def plain_server(tmp_path: Path) -> Iterator[MetricsServer]:
    web = load_web_config(web_config(tmp_path, tls=False))
    metrics = MetricsServer("127.0.0.1", 0, CollectorRegistry(),
                            lambda: (True, {"status": "ok"}), lambda: {}, web)
    metrics.start()
    yield metrics
    metrics.stop()


def get_with(url: str, authorization: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": authorization})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def basic(user: str, password: str | bytes, scheme: str = "Basic") -> str:
    raw = password if isinstance(password, bytes) else password.encode()
    return f"{scheme} " + base64.b64encode(user.encode() + b":" + raw).decode()


def test_a_password_over_72_bytes_is_a_plain_401(plain_server: MetricsServer,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{plain_server.port}/metrics"
    for user in ("prometheus", "nobody-known"):
        for _ in range(3):
            assert get_with(url, basic(user, "x" * 100)) == 401
    assert get_with(url, basic("prometheus", PASSWORD.encode() + b"y" * 80)) == 401
    assert get_with(url, basic("prometheus", PASSWORD)) == 200
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


@pytest.mark.parametrize("scheme", ["basic", "BASIC", "bAsIc"])
def test_the_basic_scheme_is_case_insensitive(plain_server: MetricsServer, scheme: str) -> None:
    url = f"http://127.0.0.1:{plain_server.port}/metrics"
    assert get_with(url, basic("prometheus", PASSWORD, scheme)) == 200
    assert get_with(url, basic("prometheus", "wrong", scheme)) == 401


def test_a_damaged_hash_or_a_file_not_in_utf8_is_refused_at_load(tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.yml"
    damaged.write_text("basic_auth_users:\n  prom: $2y$10$tooshort\n")
    with pytest.raises(WebConfigError, match="user 'prom': not a valid bcrypt hash"):
        load_web_config(damaged)
    latin1 = tmp_path / "latin1.yml"
    latin1.write_bytes(b"# caf\xe9\nbasic_auth_users: {}\n")
    with pytest.raises(WebConfigError, match="is not valid UTF-8"):
        load_web_config(latin1)
