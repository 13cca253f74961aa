"""The HTTP front's own limits (flags --http-*): how long a client may take to send a request's headers and its
body, how many connections may be open (in all, and from one client address), and how many prompts one
completion request may carry. They bound what a slow or greedy client can hold: sockets and file descriptors
(connections.py enforces the first four below the app) and queued work (app.py, the last).

Per-token shares of generation (--max-concurrent-per-token) count choices, prompts x n, so a request that
carries many prompts counts as many requests (scheduler/token_limits.py).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0  # from the connection opening (or the first byte of the next request) to the
    # end of a request's headers; past it the connection is closed (408 if some bytes came)
    body_timeout_s: float = 30.0  # from the end of the headers to the end of the body; past it: 408 and closed
    max_connections: int = 1024  # open HTTP connections in all; past it a new one is answered 503 and closed
    max_connections_per_client: int = 128  # open connections from one client IP address; past it: 429, closed
    max_prompts: int = 64  # prompts in one /v1/completions request (`prompt` as a list); more: 400

    def validate(self) -> None:
        for flag, value in (("--http-header-timeout-s", self.header_timeout_s),
                            ("--http-body-timeout-s", self.body_timeout_s)):
            if not value > 0:  # also refuses NaN
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")
        for flag, value in (("--http-max-connections", self.max_connections),
                            ("--http-max-connections-per-client", self.max_connections_per_client),
                            ("--max-prompts-per-request", self.max_prompts)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.max_connections_per_client > self.max_connections:
            raise ValueError(f"--http-max-connections-per-client ({self.max_connections_per_client}) cannot exceed "
                             f"--http-max-connections ({self.max_connections})")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = HttpLimits()
    g = ap.add_argument_group("HTTP front limits (with --http-port; docs/serving.md#limits-of-the-http-front)")
    g.add_argument("--http-header-timeout-s", type=float, default=d.header_timeout_s, metavar="S",
                   help="seconds a client has to send a request's headers, counted from the connection opening (or, "
                        "on a kept-alive connection, from the first byte of the next request); a slower one is "
                        f"closed, with a 408 if it sent anything (default {d.header_timeout_s:g})")
    g.add_argument("--http-body-timeout-s", type=float, default=d.body_timeout_s, metavar="S",
                   help="seconds a client has to send a request's body once its headers are in; a slower one gets "
                        f"408 and is closed (default {d.body_timeout_s:g})")
    g.add_argument("--http-max-connections", type=int, default=d.max_connections, metavar="N",
                   help="open HTTP connections in all; a connection past it is answered 503 (code unavailable) and "
                        f"closed, the open ones go on (default {d.max_connections})")
    g.add_argument("--http-max-connections-per-client", type=int, default=d.max_connections_per_client, metavar="N",
                   help="open HTTP connections from one client IP address; past it: 429 (code resource_exhausted) "
                        "and closed, other addresses unaffected. Behind a proxy every client has the proxy's "
                        f"address: raise it there (default {d.max_connections_per_client})")
    g.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts, metavar="N",
                   help="prompts one /v1/completions request may carry (`prompt` as a list); more is 400. Each "
                        "prompt's n choices count against --max-concurrent-per-token as requests of their own "
                        f"(default {d.max_prompts})")


def from_args(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(args.http_header_timeout_s, args.http_body_timeout_s, args.http_max_connections,
                      args.http_max_connections_per_client, args.max_prompts_per_request)
