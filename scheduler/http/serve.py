"""uvicorn serving the HTTP front on the scheduler's own event loop (one process, one loop: the routes call
the fleet directly, as the gRPC servicer does).

The socket is bound and listening before start() returns, so a port in use fails the scheduler at startup and
a client that connects right after READY waits in the kernel's backlog rather than being refused. uvicorn's
own signal handling is left out: the scheduler's loop owns SIGTERM/SIGINT and drains gRPC and HTTP alike.

With TLS (the scheduler's --tls-cert/--tls-key, --tls-client-ca for mTLS) uvicorn serves https from the same
files; they are re-read for new connections when they change (tandem/security/tls.py: reloading_ssl_context).

Connections are uvicorn's h11 protocol under a guard (connections.py): read deadlines for headers and bodies,
caps on open connections in all and per client address (HttpLimits, the --http-* flags).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

from scheduler.http.connections import ConnectionGuard, protocol_class
from scheduler.http.limits import HttpLimits
from tandem.security.tls import ReloadingTls, reloading_ssl_context

log = logging.getLogger("tandem.scheduler")
_BACKLOG = 2048
_GRACEFUL_S = 5.0  # after the scheduler's drain: how long open HTTP connections get to finish
_UVICORN_GRACEFUL_S = _GRACEFUL_S + 5.0  # uvicorn's own bound, never reached: stop() closes what is left first


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the scheduler's loop has its own SIGTERM/SIGINT handlers (the drain); keep them


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_BACKLOG)
    except OSError as exc:
        raise OSError(f"cannot listen for HTTP on {host}:{port}: {exc}") from exc
    return sock


def _tls_settings(tls: ReloadingTls | None) -> dict:
    """uvicorn's TLS settings from the scheduler's certificate files (none without TLS)."""
    if tls is None:
        return {}
    paths = tls.paths

    def factory(config: uvicorn.Config, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        return reloading_ssl_context(tls, default)  # uvicorn's own context, rebuilt after the files change

    return dict(ssl_certfile=str(paths.cert), ssl_keyfile=str(paths.key),
                ssl_ca_certs=str(paths.ca) if paths.ca is not None else None,
                ssl_cert_reqs=ssl.CERT_REQUIRED if paths.ca is not None else ssl.CERT_NONE,
                ssl_context_factory=factory)


class HttpFront:
    """The app on host:port (0 = any free port): .url once constructed; start() serves, stop() ends. tls: the
    server's certificates (https; mTLS when they include a client CA), or None (http). limits: read deadlines
    and connection caps."""

    def __init__(self, app: FastAPI, host: str, port: int, tls: ReloadingTls | None = None,
                 limits: HttpLimits | None = None) -> None:
        self._sock = _listen(host, port)
        bound = self._sock.getsockname()[1]
        self.url = f"{'https' if tls is not None else 'http'}://{f'[{host}]' if ':' in host else host}:{bound}"
        # log_config None: the scheduler's logging setup stays as it is; no access log (paths and clients of
        # every request are not worth a line each).
        self.guard = ConnectionGuard(limits or HttpLimits())
        config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=_UVICORN_GRACEFUL_S, server_header=False, backlog=_BACKLOG,
                                http=protocol_class(self.guard), ws="none",  # no WebSocket routes: no upgrades
                                **_tls_settings(tls))
        config.load()  # builds the SSL context now: a certificate that does not load fails the startup
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]), name="http")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # gRPC keeps serving; say why HTTP does not
            log.error("the HTTP server failed; gRPC goes on", exc_info=task.exception())

    async def stop(self) -> None:
        """Stops taking connections and waits for open ones (up to _GRACEFUL_S: the scheduler's drain has ended
        every generation by now, so what is left is a response its client does not read), closes those, then
        returns. Closing them is the app's ordinary client-gone path: their streams end without a traceback,
        where uvicorn's own bound would cancel the tasks mid-write and log each."""
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), _GRACEFUL_S)
        except asyncio.TimeoutError:
            unread = self._close_connections()
            log.warning("closed %d HTTP connection(s) whose clients did not read their responses within %.0f s of "
                        "the shutdown", unread, _GRACEFUL_S)
        except Exception:  # stopping anyway; say why
            log.exception("the HTTP server failed while stopping")
        if self._task.done():
            return
        try:
            await asyncio.wait_for(self._task, _UVICORN_GRACEFUL_S)
        except asyncio.TimeoutError:
            log.warning("the HTTP server did not stop within %.0fs", _GRACEFUL_S + _UVICORN_GRACEFUL_S)
        except Exception:  # stopping anyway; say why
            log.exception("the HTTP server failed while stopping")

    def _close_connections(self) -> int:
        """Aborts every connection still open (their clients see the connection end); returns how many."""
        connections = list(self._server.server_state.connections)
        for conn in connections:
            if conn.transport is not None:
                conn.transport.abort()
        return len(connections)
