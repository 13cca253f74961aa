"""The cache-release ledger: which executor caches the scheduler still has to release. Its own class because
every path that ends or moves a request (finish, abort, preemption, a failed step, a replaced prefix, the
executor's loss, a migration) adds to it, and the loop and recovery drain it; one owner keeps a cache from being
released twice or never.

Pending ids go to the executor serving now (with the next step call, or a ReleaseCache of their own). Stale ids
name caches an executor may still hold after it was lost or forgot our session: they are released once an
executor serves again (an unknown id is no error there).
"""
from __future__ import annotations

from typing import Iterable


class ReleaseLedger:
    """One engine's caches to release: pending (for the executor serving now) and stale (for when one serves
    again)."""

    def __init__(self) -> None:
        self._pending: list[str] = []
        self._stale: list[str] = []  # caches a lost executor (or a forgotten session) may still hold

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def add(self, cache_id: str) -> None:
        """A cache to release on the executor serving now."""
        self._pending.append(cache_id)

    def take(self, limit: int | None = None) -> list[str]:
        """The caches to release on the executor now (at most limit; the rest stay pending)."""
        ids, self._pending = self._pending[:limit], self._pending[len(self._pending[:limit]):]
        return ids

    def failed(self, cache_ids: list[str]) -> None:
        """The release did not reach the executor: keep the ids for the next try."""
        self._pending.extend(cache_ids)

    def executor_lost(self, held: Iterable[str]) -> None:
        """The executor was lost (or forgot our session): what was pending, and the caches it held for us
        (held), become stale."""
        self._stale += self._pending + list(held)
        self._pending = []

    def take_stale(self) -> list[str]:
        ids, self._stale = self._stale, []
        return ids

    def keep_stale(self, cache_ids: Iterable[str]) -> None:
        """Caches an executor that is gone may hold (or stale ones whose release failed: the next try)."""
        self._stale.extend(cache_ids)
