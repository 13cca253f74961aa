"""tandem/metrics_http.py in process: a connection that sends nothing (or speaks plaintext to the TLS port)
holds neither the accept loop nor other scrapes; open without TLS and tokens; the log line names the scheme
and what a scrape needs."""
from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from tandem import metrics_http
from tandem.metrics_http import serve_metrics
from tandem.security.auth import Authenticator
from tandem.security.tls import ReloadingTls, server_paths
from tandem.security.tokens import TokenFile
from tests.security_fixtures import make_pki, new_token, write_tokens

ADMIN = new_token()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture()
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("tandem_test_scrapes", "a counter to find in the exposition", registry=registry).inc(3)
    return registry


def test_open_without_tls_or_tokens(registry, caplog):
    with caplog.at_level(logging.INFO, logger="t"):
        server = serve_metrics(registry, "127.0.0.1", 0, logging.getLogger("t"))
    try:
        assert f"metrics on http://127.0.0.1:{server.server_port}/metrics" in caplog.text
        assert "needs" not in caplog.text
        got = httpx.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10)
        assert got.status_code == 200 and "tandem_test_scrapes_total 3.0" in got.text
    finally:
        server.shutdown()


def test_a_silent_connection_holds_no_other_scrape(registry, pki, tmp_path, caplog):
    cert, key = pki.server()
    tls = ReloadingTls(server_paths(cert, key, None))
    tokens = Authenticator(TokenFile(write_tokens(tmp_path / "tokens", {ADMIN: "admin"})))
    with caplog.at_level(logging.INFO, logger="t"):
        server = serve_metrics(registry, "127.0.0.1", 0, logging.getLogger("t"), tls, tokens)
    url = f"https://127.0.0.1:{server.server_port}/metrics"
    silent = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(3)]  # no ClientHello
    try:
        assert f"metrics on {url} (needs an admin token)" in caplog.text
        plain = socket.create_connection(("127.0.0.1", server.server_port))
        plain.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # plaintext to the TLS port: closed, nothing served
        plain.settimeout(10)
        try:
            answer = plain.recv(4096)  # an alert, or nothing
        except ConnectionResetError:  # closed with the request unread: the kernel resets
            answer = b""
        assert b"tandem_test" not in answer
        plain.close()
        start = time.monotonic()
        with httpx.Client(verify=str(pki.ca), timeout=10) as http:
            assert http.get(url).status_code == 401
            got = http.get(url, headers={"authorization": f"Bearer {ADMIN}"})
        assert got.status_code == 200 and "tandem_test_scrapes_total 3.0" in got.text
        assert time.monotonic() - start < 5  # not behind the silent connections' handshake timeout
    finally:
        for s in silent:
            s.close()
        server.shutdown()


def test_connections_past_the_cap_are_closed_and_the_slots_come_back(registry, monkeypatch):
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 2)
    server = serve_metrics(registry, "127.0.0.1", 0, logging.getLogger("t"))
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    holders = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(2)]  # send nothing
    try:
        end = time.monotonic() + 10
        while server.slots._value:  # (CPython's count) until both are accepted and hold their slots
            assert time.monotonic() < end, "the holders were not accepted"
            time.sleep(0.01)
        with pytest.raises(httpx.HTTPError):  # a third connection: closed unanswered
            httpx.get(url, timeout=10)
        for s in holders:
            s.close()
        end = time.monotonic() + 10
        while True:  # the holders' threads see EOF and free their slots
            try:
                assert httpx.get(url, timeout=10).status_code == 200
                break
            except httpx.HTTPError:
                assert time.monotonic() < end, "the slots did not come back"
                time.sleep(0.05)
    finally:
        server.shutdown()
