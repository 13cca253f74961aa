"""The scheduler's session on its executor: the caches it creates belong to the session and live while the
session's lease does, so a scheduler that dies strands no KV (the executor frees them after the lease).

Every call that names the session renews the lease; when the scheduler is idle it renews it with KeepAlive
a third of the lease after the last renewal. An executor that answers OpenSession with an error — one that
predates sessions answers UNIMPLEMENTED, or INTERNAL through its error interceptor — leaves the id empty:
calls then go to its anonymous session (the scheduler works as before) and nothing needs renewing.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from scheduler.executor.client import ExecutorClient
from tandem.errors import RemoteError

MAX_CLIENT_NAME = 128  # the contract's limit on OpenSessionRequest.client_name
log = logging.getLogger("tandem.scheduler")


class ExecutorSession:
    def __init__(self, client: ExecutorClient, client_name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.client_name = client_name[:MAX_CLIENT_NAME]
        self.id = ""  # "" = no session (none open, or the executor has none): the anonymous session
        self.ttl_s = 0.0  # the lease; 0 = nothing to renew
        self._clock = clock
        self._renewed_at = 0.0

    async def open(self, default_ttl_ms: int = 0) -> None:
        """Opens a new session (the old id, if any, is forgotten: close it first if it may still exist).
        default_ttl_ms: the lease GetInfo reports (session_ttl_ms), if OpenSession does not say. Raises
        ExecutorUnreachable; an error answer leaves the id "" (the anonymous session)."""
        self.id, self.ttl_s = "", 0.0
        started = self._clock()
        try:
            resp = await self.client.open_session(self.client_name)
        except RemoteError as exc:
            level = logging.INFO if exc.status_name in ("UNIMPLEMENTED", "INTERNAL") else logging.WARNING
            log.log(level, "no session on executor %s (OpenSession: %s %s); using its anonymous session",
                    self.client.address, exc.status_name, exc)
            return
        self.id, self.ttl_s = resp.session_id, (resp.lease_ttl_ms or default_ttl_ms) / 1000.0
        self._renewed_at = started

    def renewed(self, at: float) -> None:
        """A call naming the session, sent at `at` (the clock's time), succeeded: the lease runs from then."""
        self._renewed_at = max(self._renewed_at, at)

    def keep_alive_in(self) -> float | None:
        """Seconds until the lease should be renewed (<= 0: now); None when there is no lease to renew."""
        if not self.id or self.ttl_s <= 0:
            return None
        return self._renewed_at + self.ttl_s / 3 - self._clock()

    async def keep_alive(self) -> None:
        """Renews the lease. RemoteError NOT_FOUND: the session is gone (expired, or the executor restarted)."""
        started = self._clock()
        resp = await self.client.keep_alive(self.id)
        if resp.lease_ttl_ms:
            self.ttl_s = resp.lease_ttl_ms / 1000.0
        self.renewed(started)

    def retry_keep_alive_in(self, seconds: float) -> None:
        """A KeepAlive got no useful answer: try again in `seconds` rather than at once."""
        self._renewed_at = self._clock() + seconds - self.ttl_s / 3

    def forget(self) -> str:
        """The executor was lost: the session is no longer ours to use. Returns its id (to close it if that
        same executor answers again)."""
        session_id, self.id = self.id, ""
        return session_id

    async def close(self) -> None:
        """Closes the session: the executor releases every cache it still holds. Idempotent."""
        session_id, self.id = self.id, ""
        if session_id:
            await self.client.close_session(session_id)
