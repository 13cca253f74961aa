"""Client sessions and their leases: who owns the executor's caches, and until when.

Every cache belongs to a session. A client opens one (OpenSession) and names it in its calls; every call
naming it, and KeepAlive, renews its lease. A session that is closed, or whose lease lapsed (no call for
ttl_s) when the reaper looks, loses all its caches and is forgotten. Calls that name no session use the
anonymous session, under the same rule: it is never unknown, but its caches go once it lapses.

A session with a call in flight (queued or running) never lapses: its lease counts from the end of its
last call. So a call never has its caches reaped under it, and the caches a call creates always land in a
live session. A session closed while a call of it waits in the queue makes that call NOT_FOUND when it
starts; CloseSession waits for the call in progress, so it also releases what that call created.

Lapse is decided only by `take_lapsed`, which the executor calls under its model lock before releasing the
lapsed sessions' caches (so no call can create a cache in between and KV accounting stays exact). A call
arriving after the deadline but before the reaper ran still finds its session: the lease is a minimum, and
with the server's reaper waking every ttl/4 a silent client's caches go within 1.25 x ttl. The in-process
Executor reaps only when asked (reap_lapsed), so direct users see no expiry at all.

This registry has its own short lock and never waits for a model call: OpenSession, KeepAlive, ListCaches
and pinning a session when an RPC arrives stay prompt whatever the model thread is doing.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from tandem.errors import InvalidRequest, SessionNotFound

log = logging.getLogger("tandem.executor")

ANONYMOUS = ""  # the session id of calls that name none
MAX_CLIENT_NAME = 128
MAX_TTL_S = 24 * 3600.0  # the lease travels as uint32 milliseconds; a day is far beyond any sane lease

Clock = Callable[[], float]  # seconds, monotonic


@dataclass
class Session:
    session_id: str  # ANONYMOUS for the anonymous session
    client_name: str
    created: float  # clock seconds
    deadline: float  # clock seconds; meaningless while in_flight > 0
    in_flight: int = 0  # calls received and not finished (queued or running)

    def lapsed(self, now: float) -> bool:
        return self.in_flight == 0 and now >= self.deadline

    def expires_in(self, now: float, ttl_s: float) -> float:
        """Seconds until the lease ends unless renewed (a session in flight: a full TTL after its call)."""
        return ttl_s if self.in_flight else max(0.0, self.deadline - now)


def check_ttl(ttl_s: float) -> None:
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"--session-ttl must be in (0, {MAX_TTL_S:.0f}] seconds, got {ttl_s}")


class SessionRegistry:
    def __init__(self, ttl_s: float, clock: Clock = time.monotonic) -> None:
        check_ttl(ttl_s)
        self.ttl_s = ttl_s
        self.clock = clock
        self._guard = threading.Lock()
        now = clock()
        self._live: dict[str, Session] = {ANONYMOUS: Session(ANONYMOUS, "", now, now + ttl_s)}

    # ----------------------------------------------------------------- client calls
    def open(self, client_name: str) -> Session:
        if len(client_name) > MAX_CLIENT_NAME:
            raise InvalidRequest(f"{{field}} has {len(client_name)} characters; at most {MAX_CLIENT_NAME}",
                                 "client_name")
        now = self.clock()
        sid = uuid.uuid4().hex
        session = Session(sid, client_name, now, now + self.ttl_s)
        with self._guard:
            self._live[sid] = session
        log.info("session %s… opened by %r (lease %.1fs)", sid[:8], client_name, self.ttl_s)
        return session

    def renew(self, session_id: str) -> Session:
        """The session, its lease renewed; SessionNotFound if unknown (never opened, closed or reaped)."""
        with self._guard:
            session = self._get(session_id)
            session.deadline = self.clock() + self.ttl_s
            return session

    @contextmanager
    def pinned(self, session_id: str) -> Iterator[Session]:
        """Holds the session live for the duration of a call (its lease renewed when the call ends);
        SessionNotFound at once if it is unknown."""
        with self._guard:
            session = self._get(session_id)
            session.in_flight += 1
        try:
            yield session
        finally:
            with self._guard:
                session.in_flight -= 1
                session.deadline = self.clock() + self.ttl_s

    def close(self, session_id: str) -> Session | None:
        """Forgets a session and returns it (its caches are the caller's to release); None if unknown."""
        if session_id == ANONYMOUS:
            raise InvalidRequest("{field} is empty: the anonymous session is shared and cannot be closed; "
                                 "ReleaseCache its caches instead (they also go when its lease lapses)", "session_id")
        with self._guard:
            session = self._live.pop(session_id, None)
        if session is not None:
            log.info("session %s… (%r) closed", session_id[:8], session.client_name)
        return session

    def find(self, session_id: str) -> Session:
        """The session, without renewing it (listing must not keep a dead client's caches alive)."""
        with self._guard:
            return self._get(session_id)

    # ----------------------------------------------------------------- reaping and listing
    def take_lapsed(self) -> list[Session]:
        """The sessions whose lease lapsed: named ones are forgotten, the anonymous one stays (emptied by
        the caller). The caller releases their caches, under the lock that every cache creation takes."""
        with self._guard:
            now = self.clock()
            lapsed = [s for s in self._live.values() if s.lapsed(now)]
            for s in lapsed:
                if s.session_id != ANONYMOUS:
                    del self._live[s.session_id]
                    log.info("session %s… (%r) expired: no call within %.1fs", s.session_id[:8], s.client_name,
                             self.ttl_s)
        return lapsed

    def listing(self) -> list[tuple[Session, float]]:
        """(session, seconds until its lease ends unless renewed; 0 = lapsed, about to be reaped), oldest
        first."""
        with self._guard:
            now = self.clock()
            rows = [(s, s.expires_in(now, self.ttl_s)) for s in self._live.values()]
        return sorted(rows, key=lambda r: r[0].created)

    def _get(self, session_id: str) -> Session:
        session = self._live.get(session_id)
        if session is None:
            raise SessionNotFound(session_id)
        return session


class LeaseReaper:
    """A daemon thread that calls reap() every interval_s until stopped (the server's; in-process users
    call the executor's reap_lapsed themselves)."""

    def __init__(self, reap: Callable[[], int], interval_s: float) -> None:
        self._reap = reap
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._reap()
            except Exception:  # a bug: keep reaping, or expired sessions would hold KV for ever
                log.exception("reaping expired sessions failed")
