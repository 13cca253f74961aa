"""The executor's table of caches: cache id -> what it records per cache (blocks, tokens, prompt end, adapter).

Ids are handed out only once a cache's first forward succeeded, so a failed call never leaves an entry.
Ownership (sessions, leases: issue 11) belongs here too.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Iterator

from executor_service.types import CacheRef
from models.kv_cache import BlockTable, PagedKvCache
from tandem.errors import CacheNotFound
from tandem.sampling_params import SamplingParams


@dataclass
class CacheState:
    """What the executor records per cache: its blocks, every token written (for penalties) and where the
    prompt ended (tokens after it are outputs fed back, which presence/frequency penalties count)."""

    table: BlockTable = field(default_factory=BlockTable)
    tokens: list[int] = field(default_factory=list)
    prompt_len: int | None = None
    adapter: str = ""  # fixed at creation: the KV holds this adapter's k/v projections
    # Registered with the cache: used by items that send no sampling parameters (set at creation, replaced
    # by every item that sends some).
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @classmethod
    def new(cls) -> "CacheState":
        return cls()

    @property
    def num_output_tokens(self) -> int:
        return 0 if self.prompt_len is None else len(self.tokens) - self.prompt_len

    def snapshot(self) -> "CacheSnapshot":
        """What a call may change, to put back if it fails after changing it."""
        return CacheSnapshot(self, self.table.length, len(self.tokens), self.prompt_len, self.sampling)

    def truncate(self, new_len: int) -> None:
        del self.tokens[new_len:]
        if self.prompt_len is not None and self.prompt_len > new_len:
            self.prompt_len = new_len


@dataclass(frozen=True)
class CacheSnapshot:
    state: CacheState
    length: int
    num_tokens: int
    prompt_len: int | None
    sampling: SamplingParams

    def restore(self, kv: PagedKvCache) -> None:
        """Puts the cache back as it was: blocks past the old length freed, tokens, prompt end and sampling."""
        kv.truncate(self.state.table, self.length)
        del self.state.tokens[self.num_tokens:]
        self.state.prompt_len = self.prompt_len
        self.state.sampling = self.sampling


class CacheTable:
    def __init__(self) -> None:
        self._caches: dict[str, CacheState] = {}

    def get(self, cache_id: str | None) -> CacheState:
        """The named cache's state; CacheNotFound when it was never created or is released."""
        state = self._caches.get(cache_id or "")
        if state is None:
            raise CacheNotFound(cache_id or "")
        return state

    def __getitem__(self, cache_id: str) -> CacheState:
        return self.get(cache_id)

    def __contains__(self, cache_id: object) -> bool:
        return cache_id in self._caches

    def __len__(self) -> int:
        return len(self._caches)

    def __iter__(self) -> Iterator[str]:
        return iter(self._caches)

    def add(self, state: CacheState) -> str:
        """Names a cache created by a successful forward."""
        cache_id = uuid.uuid4().hex
        self._caches[cache_id] = state
        return cache_id

    def pop(self, cache_id: str) -> CacheState | None:
        return self._caches.pop(cache_id, None)

    def ref(self, cache_id: str) -> CacheRef:
        state = self._caches.get(cache_id)
        return CacheRef(cache_id, state.table.length if state else 0)

    def adapter_users(self) -> dict[str, int]:
        """Adapter name -> live caches created with it."""
        counts: dict[str, int] = {}
        for s in self._caches.values():
            if s.adapter:
                counts[s.adapter] = counts.get(s.adapter, 0) + 1
        return counts
