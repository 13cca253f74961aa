"""The connection guard of the HTTP front: uvicorn's h11 protocol with read deadlines and connection caps
(HttpLimits, the --http-* flags). uvicorn closes idle kept-alive connections (timeout_keep_alive) but has no
deadline for a request being read: a client that trickles its headers or its body a byte at a time would hold
its socket, and a file descriptor, for ever. Here every connection is always in one of three phases, read from
h11's view of the client:

- headers (the client's state IDLE, from the connection opening, or from the first byte of the next request
  on a kept-alive connection): they must be in within --http-header-timeout-s;
- body (SEND_BODY, from the end of the headers): within --http-body-timeout-s;
- none (the request is read; the app is answering, or the connection waits idle between requests under
  uvicorn's keep-alive timeout).

A deadline is set when a phase begins, never pushed back by bytes that arrive. Past it the connection gets a
408 with the OpenAI error body if a response can still be sent (some bytes came and no response has begun)
and is closed; the app sees a disconnect. Connections past --http-max-connections (503) or from an address
that holds --http-max-connections-per-client (429) get that error with `Retry-After: 1` (a place opens when
one of the client's own connections ends, which no rate predicts: soon is the honest answer), once their
request is read, and are closed; they are not counted, so they never hold a place. Garbage that is not HTTP
gets uvicorn's 400 with the OpenAI error body instead of plain text.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from scheduler.http import errors
from scheduler.http.limits import HttpLimits

log = logging.getLogger("tandem.scheduler")
RETRY_AFTER_S = 1  # a refused connection's Retry-After (whole seconds)


class ConnectionGuard:
    """The connections admitted, in all and per client address (shared by every connection of a server)."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.open = 0
        self.per_client: Counter[str] = Counter()
        # connections refused, by tandem:requests_refused_total's reason (read by the metrics; both keys from the
        # start, so a scrape's copy on another thread never meets a dict changing size)
        self.refused: Counter[str] = Counter({"http_connections": 0, "http_connections_per_client": 0})

    def admit(self, client: str) -> tuple[int, str] | None:
        """Counts a new connection from `client` and returns None, or returns (status, message) refusing it."""
        lim = self.limits
        if self.open >= lim.max_connections:
            self.refused["http_connections"] += 1
            return 503, (f"this server has {self.open} HTTP connections open, its limit (--http-max-connections "
                         f"{lim.max_connections}); retry shortly")
        if self.per_client[client] >= lim.max_connections_per_client:
            self.refused["http_connections_per_client"] += 1
            return 429, (f"your address has {self.per_client[client]} HTTP connections open, the limit per client "
                         f"(--http-max-connections-per-client {lim.max_connections_per_client}); reuse or close "
                         "some")
        self.open += 1
        self.per_client[client] += 1
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]


def _refusal(status: int, message: str):
    """An ASGI app that reads the request body (so the client sees the answer, not a reset) and answers the
    error with Connection: close."""

    async def app(scope: dict, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        response = errors.response(status, message)
        response.headers["connection"] = "close"
        response.headers["retry-after"] = str(RETRY_AFTER_S)  # (RFC 9110: on a 429 or a 503)
        await response(scope, receive, send)

    return app


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ConnectionGuard (bind one with protocol_class)."""

    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None  # "headers", "body", "idle" or None (the app has the request)
        self._deadline: asyncio.TimerHandle | None = None
        self._heard = False  # bytes arrived in the current phase
        self._counted: str | None = None  # the client address admitted (released when the connection ends)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client[0] if self.client else "local"  # a Unix socket has no address
        refused = self.guard.admit(client)
        if refused is None:
            self._counted = client
        else:
            log.info("HTTP connection from %s refused: %d", client, refused[0])
            self.app = _refusal(*refused)
        self._enter("headers")

    def data_received(self, data: bytes) -> None:
        self._heard = True
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._enter("idle")  # uvicorn's keep-alive timeout has it until the next request's first byte
        else:
            self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(None)
        if self._counted is not None:
            self.guard.release(self._counted)
            self._counted = None
        super().connection_lost(exc)

    def _follow(self) -> None:
        """The phase h11's view of the client calls for after bytes arrived or a response ended."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._phase != "headers":
                self._enter("headers")
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self._enter("body")
        else:
            self._enter(None)

    def _enter(self, phase: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is None or phase == "idle":
            self._heard = False  # until the next request's first byte
        else:
            limits = self.guard.limits
            seconds = limits.header_timeout_s if phase == "headers" else limits.body_timeout_s
            self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        # A response can still be sent: bytes of a request came and the app has not begun answering it.
        answer = self._heard if phase == "headers" else self.cycle is not None and not self.cycle.response_started
        flag, seconds = (("--http-header-timeout-s", self.guard.limits.header_timeout_s) if phase == "headers"
                         else ("--http-body-timeout-s", self.guard.limits.body_timeout_s))
        if answer:
            self.transport.write(errors.raw_response(
                408, "Request Timeout", f"the request's {phase} did not arrive within {seconds:g} s ({flag}); "
                "the connection is closed", "deadline_exceeded"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """Bytes that are not HTTP/1.1: 400 with the OpenAI error body, then closed (uvicorn sends plain text)."""
        self.transport.write(errors.raw_response(400, "Bad Request", "the bytes received are not a valid HTTP/1.1 "
                                                 "request (or its headers are over 16 KiB)", "invalid_argument"))
        self.transport.close()


def protocol_class(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol class bound to `guard` (uvicorn makes one protocol per connection from a class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
