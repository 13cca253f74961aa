"""Serving a Prometheus registry over plain HTTP (GET /metrics), for both servers' --metrics-port."""
from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


def serve_metrics(registry: CollectorRegistry, host: str, port: int, log: logging.Logger) -> WSGIServer:
    """Serves registry on host:port from a daemon thread (0: any free port) and logs the URL — the line
    `metrics on http://HOST:PORT/metrics` is how a caller that asked for port 0 learns the port. shutdown()
    the returned server to stop it. OSError when the port cannot be bound."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    where = f"[{host}]" if ":" in host else host
    log.info("metrics on http://%s:%d/metrics", where, server.server_port)
    return server
