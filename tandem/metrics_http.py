"""Serving a Prometheus registry (GET /metrics) for both servers' --metrics-port, under the server's own
security: with --tls-cert/--tls-key it is https from the same files (re-read for new connections when they
change, as the gRPC port), with --tls-client-ca a client certificate is required in the handshake (mTLS), and
with --auth-token-file a scrape needs an admin token (`Authorization: Bearer`, Prometheus' `authorization`
setting) — the same rule as the scheduler's HTTP front: the metrics are the operator's view of every client's
traffic. Without those it is plain HTTP, open, on the server's --host (127.0.0.1 by default).

The exposition is prometheus_client's WSGI app; the server is wsgiref's, one thread per connection, at most
MAX_CONNECTIONS at once (more are closed unanswered). The TLS handshake runs in that connection's thread,
under a timeout, so a client that connects and sends nothing holds neither the accept loop nor a thread for
long.
"""
from __future__ import annotations

import logging
import socket
import socketserver
import ssl
import threading
from typing import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import CollectorRegistry, make_wsgi_app

from tandem.errors import TandemError
from tandem.security.auth import Authenticator
from tandem.security.tls import ReloadingTls, reloading_ssl_context
from tandem.security.tokens import Scope
from tandem.status_map import status_for

CONNECTION_TIMEOUT_S = 10.0  # a connection's handshake and request must arrive within this
MAX_CONNECTIONS = 16  # served at once (a thread each); more are closed at once: a flood costs no threads
_HTTP_OF = {grpc.StatusCode.UNAUTHENTICATED: "401 Unauthorized", grpc.StatusCode.PERMISSION_DENIED: "403 Forbidden"}


def tls_context(tls: ReloadingTls) -> ssl.SSLContext:
    """A server context from the current files: the certificate chain, and the client CA (mTLS) if given."""
    def build() -> ssl.SSLContext:
        paths = tls.paths
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(paths.cert, paths.key)
        if paths.ca is not None:
            context.load_verify_locations(paths.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context
    return reloading_ssl_context(tls, build)


def guarded_app(app: Callable, authenticator: Authenticator | None) -> Callable:
    """app behind the bearer-token check (admin scope) when tokens are on."""
    if authenticator is None or not authenticator.on:
        return app

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        try:
            authenticator.check(environ.get("HTTP_AUTHORIZATION"), Scope.ADMIN, "/metrics")
        except TandemError as exc:
            status = _HTTP_OF.get(status_for(exc), "403 Forbidden")
            headers = [("Content-Type", "text/plain; charset=utf-8")]
            if status.startswith("401"):
                headers.append(("WWW-Authenticate", "Bearer"))
            start_response(status, headers)
            return [f"{exc}\n".encode()]
        return app(environ, start_response)
    return guarded


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - no access log (one line per scrape)
        pass


class _MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    context: ssl.SSLContext | None = None  # TLS when set
    slots: threading.BoundedSemaphore  # MAX_CONNECTIONS

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # at the cap: closed unanswered (Prometheus retries next interval)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def get_request(self) -> tuple[socket.socket, object]:
        sock, address = self.socket.accept()
        sock.settimeout(CONNECTION_TIMEOUT_S)
        if self.context is not None:  # the handshake happens in the connection's thread (finish_request)
            sock = self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def finish_request(self, request, client_address) -> None:
        if isinstance(request, ssl.SSLSocket):
            try:
                request.do_handshake()
            except (ssl.SSLError, OSError):  # plaintext, a wrong or missing client certificate, a timeout
                return
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        pass  # a client that went away mid-request: nothing to log


def serve_metrics(registry: CollectorRegistry, host: str, port: int, log: logging.Logger,
                  tls: ReloadingTls | None = None, authenticator: Authenticator | None = None) -> WSGIServer:
    """Serves registry on host:port from a daemon thread (0: any free port) and logs the URL — the line
    `metrics on http(s)://HOST:PORT/metrics` is how a caller that asked for port 0 learns the port.
    shutdown() the returned server to stop it. OSError when the port cannot be bound; ssl.SSLError / OSError
    when the certificate files do not load."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (_MetricsServer,), {"address_family": family})
    server = make_server(host, port, guarded_app(make_wsgi_app(registry), authenticator), server_class, _Handler)
    server.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
    if tls is not None:
        server.context = tls_context(tls)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    where = f"[{host}]" if ":" in host else host
    scheme = "https" if tls is not None else "http"
    needs = (["a client certificate"] if tls is not None and tls.paths.ca is not None else []) + \
        (["an admin token"] if authenticator is not None and authenticator.on else [])
    log.info("metrics on %s://%s:%d/metrics%s", scheme, where, server.server_port,
             f" (needs {' and '.join(needs)})" if needs else "")
    return server
