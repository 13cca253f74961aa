"""A bound on the calls one gRPC server serves at once, answered RESOURCE_EXHAUSTED on arrival.

Why the application counts, and gRPC core is told to hold more: the asyncio server takes incoming calls from
gRPC core one at a time, on its event loop. Core keeps the calls that arrived but were not taken yet in a
backlog, and past `grpc.server.max_pending_requests` (1000 by default; all of them at the hard limit, 3000)
it drops new ones at random with a bare RST_STREAM: the client sees CANCELLED with no message, and the
application never hears of the call, so nothing is logged (2,000 Generate streams opened at once on one
channel lost ~10 % this way, within half a second). So core's backlog is set far above the limit here
(`backlog_options`), every call is taken, and the ones over the limit are refused by the interceptor
(`CallLimit.hold`) before they cost anything: a precise RESOURCE_EXHAUSTED naming the limit and its flag.
What remains is core's own last line: a call left untaken for 30 s (an event loop that far behind) is
cancelled, and a backlog past `backlog_options` drops calls as before."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from tandem.errors import TooManyCalls

MIN_BACKLOG = 16384


def backlog_options(limit: int) -> list[tuple[str, int]]:
    """gRPC core server options: a backlog of calls not yet taken by the application large enough that core
    never drops them itself (8x the limit, at least MIN_BACKLOG: 6,000 streams opened at once on one channel
    fit, where core's default 1,000 lost ~20 % of them). A pending call costs core a few KB."""
    backlog = max(MIN_BACKLOG, 8 * limit)
    return [("grpc.server.max_pending_requests", backlog), ("grpc.server.max_pending_requests_hard_limit", backlog)]


class CallLimit:
    def __init__(self, limit: int, flag: str, server: str) -> None:
        if limit < 1:
            raise ValueError(f"{flag} must be >= 1, got {limit}")
        self.limit = limit
        self._flag = flag
        self._server = server
        self._lock = threading.Lock()
        self.active = 0
        self.refused = 0

    @contextmanager
    def hold(self) -> Iterator[None]:
        """One call's place for its whole life; TooManyCalls when every place is taken."""
        with self._lock:
            if self.active >= self.limit:
                self.refused += 1
                raise TooManyCalls(f"the {self._server} is serving its limit of {self.limit} calls at once "
                                   f"({self._flag}); retry later")
            self.active += 1
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1
