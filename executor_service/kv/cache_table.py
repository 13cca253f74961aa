"""The executor's caches: cache id -> what it records per cache (blocks, tokens, prompt end, adapter, owner).

Every cache is owned by one session (executor_service/sessions.py). `CacheStore` holds them all, indexed by
owner; a `CacheTable` is one session's view of it, the only one an operation gets: another session's cache
is as unknown to it as an id never created (NOT_FOUND; ReleaseCache reports it unknown). Ids are handed
out only once a cache's first forward succeeded (`CacheTable.add`), so a failed call never leaves an entry.

The store's own short lock guards its index, so listings (ListCaches, GetInfo, ListAdapters) never wait for
a model call; changes still happen only under the executor's model lock. A listing taken while a call
extends a cache shows that cache's length before or after the call.
"""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from executor_service.prompt_logprobs import PromptLogprobTrail
from executor_service.sessions import ANONYMOUS, SessionRegistry
from executor_service.types import CacheListing, CacheRef, SessionListing
from models.kv.paged_cache import BlockTable, PagedKvCache
from tandem.errors import CacheNotFound
from tandem.sampling_params import SamplingParams


@dataclass
class CacheState:
    """What the executor records per cache: its blocks, every token written (for penalties), where the
    prompt ended (tokens after it are outputs fed back, which presence/frequency penalties count), and who
    owns it since when."""

    table: BlockTable = field(default_factory=BlockTable)
    tokens: list[int] = field(default_factory=list)
    prompt_len: int | None = None
    adapter: str = ""  # fixed at creation: the KV holds this adapter's k/v projections
    session: str = ""  # the owning session's id ("" = the anonymous session); set by CacheTable.add
    created: float = 0.0  # the store's clock (seconds) when it was added
    # Registered with the cache: used by items that send no sampling parameters (set at creation, replaced
    # by every item that sends some).
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Prefix caching: the parent hash of its first block (adapter, weights digest, cache salt), and the
    # tokens reused when CreateCache created it.
    root: bytes = b""
    cached_tokens: int = 0
    # Prompt logprobs (executor_service/prompt_logprobs.py): the final hidden state [hidden_size] of the last
    # written position when the last item asked for them (or CreateCache restored it), to score the next
    # item's first token; and what was computed for the blocks not yet stored beside the prefix cache.
    plp_hidden: torch.Tensor | None = None
    plp_trail: PromptLogprobTrail | None = None
    # Mean pooling (executor_service/step/pooling.py): the float32 sum [hidden_size] of the final hidden states of
    # positions 0 .. pool_rows - 1, while every item since position 0 asked for it; None otherwise.
    pool_sum: torch.Tensor | None = None
    pool_rows: int = 0
    # Vision: the spans of the images it shows (offset, length, content hash), as items brought them; they key
    # the blocks they overlap in the prefix cache.
    images: list[tuple[int, int, str]] = field(default_factory=list)
    # M-RoPE (executor_service/vision/mrope.py): each image's merged grid (rows, columns) by span offset, as items
    # and CreateCache brought them (read only for the spans in `images`)
    image_grids: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return 0 if self.prompt_len is None else len(self.tokens) - self.prompt_len

    def snapshot(self) -> "CacheSnapshot":
        """What a call may change, to put back if it fails after changing it."""
        return CacheSnapshot(self, self.table.length, len(self.tokens), self.prompt_len, self.sampling,
                             self.table.blocks[-1] if self.table.blocks else None, self.plp_hidden, self.plp_trail,
                             self.pool_sum, self.pool_rows, tuple(self.images))

    def truncate(self, new_len: int) -> None:
        if new_len < len(self.tokens):  # the kept hidden state, trail and pooled sum are of positions now gone
            self.plp_hidden = self.plp_trail = self.pool_sum = None
            self.pool_rows = 0
        del self.tokens[new_len:]
        self.images = [s for s in self.images if s[0] < new_len]  # (an image cut short still keys its blocks)
        if self.prompt_len is not None and self.prompt_len > new_len:
            self.prompt_len = new_len


@dataclass(frozen=True)
class CacheSnapshot:
    state: CacheState
    length: int
    num_tokens: int
    prompt_len: int | None
    sampling: SamplingParams
    last_block: int | None  # the table's last block (a failed call's copy-on-write of it is undone)
    plp_hidden: torch.Tensor | None = None
    plp_trail: PromptLogprobTrail | None = None
    pool_sum: torch.Tensor | None = None
    pool_rows: int = 0
    images: tuple[tuple[int, int, str], ...] = ()

    def restore(self, kv: PagedKvCache) -> None:
        """Puts the cache back as it was: blocks past the old length freed (and the last block itself if the
        call copied it), tokens, prompt end and sampling."""
        kv.truncate(self.state.table, self.length)
        kv.undo_copy(self.state.table, self.last_block)
        del self.state.tokens[self.num_tokens:]
        self.state.prompt_len = self.prompt_len
        self.state.sampling = self.sampling
        self.state.plp_hidden, self.state.plp_trail = self.plp_hidden, self.plp_trail
        self.state.pool_sum, self.state.pool_rows = self.pool_sum, self.pool_rows
        self.state.images = list(self.images)


class CacheStore:
    """Every cache the executor holds, by id and by owning session."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._guard = threading.Lock()
        self._caches: dict[str, CacheState] = {}
        self._owned: dict[str, dict[str, None]] = {}  # session id -> its cache ids, oldest first

    def view(self, session_id: str) -> "CacheTable":
        return CacheTable(self, session_id)

    def __len__(self) -> int:
        return len(self._caches)

    def owned(self, session_id: str) -> list[tuple[str, CacheState]]:
        """A session's caches, oldest first (a snapshot)."""
        with self._guard:
            return [(cid, self._caches[cid]) for cid in self._owned.get(session_id, ())]

    def counts(self) -> dict[str, int]:
        """Session id -> caches it holds (sessions holding none are absent)."""
        with self._guard:
            return {sid: len(ids) for sid, ids in self._owned.items() if ids}

    def pop_session(self, session_id: str) -> list[CacheState]:
        """Removes every cache of a session and returns them (the caller frees their blocks)."""
        with self._guard:
            ids = self._owned.pop(session_id, {})
            return [self._caches.pop(cid) for cid in ids]

    def listings(self, sessions: SessionRegistry, session_id: str | None) -> list[SessionListing]:
        """The sessions (one, or all: the anonymous one only when it holds caches) with their caches."""
        if session_id is not None:
            sessions.find(session_id)  # SessionNotFound
        now = sessions.clock()
        listing = []
        for s, expires_in in sessions.listing():
            if session_id is not None and s.session_id != session_id:
                continue
            caches = [CacheListing(cid, st.table.length, st.adapter, max(0.0, now - st.created), st.table.held)
                      for cid, st in self.owned(s.session_id)]
            if caches or s.session_id != ANONYMOUS or session_id is not None:
                listing.append(SessionListing(s.session_id, s.client_name, expires_in, caches))
        return listing

    def adapter_users(self) -> dict[str, int]:
        """Adapter name -> live caches created with it, in every session."""
        counts: dict[str, int] = {}
        with self._guard:
            for s in self._caches.values():
                if s.adapter:
                    counts[s.adapter] = counts.get(s.adapter, 0) + 1
        return counts

    # ----------------------------------------------------------------- for CacheTable
    def _get(self, session_id: str, cache_id: str) -> CacheState | None:
        state = self._caches.get(cache_id)
        return state if state is not None and state.session == session_id else None

    def _add(self, session_id: str, state: CacheState) -> str:
        cache_id = uuid.uuid4().hex
        state.session, state.created = session_id, self.clock()
        with self._guard:
            self._caches[cache_id] = state
            self._owned.setdefault(session_id, {})[cache_id] = None
        return cache_id

    def _pop(self, session_id: str, cache_id: str) -> CacheState | None:
        with self._guard:
            if self._get(session_id, cache_id) is None:
                return None
            ids = self._owned[session_id]
            del ids[cache_id]
            if not ids:
                del self._owned[session_id]
            return self._caches.pop(cache_id)

    def _ids(self, session_id: str) -> list[str]:
        with self._guard:
            return list(self._owned.get(session_id, ()))


class CacheTable:
    """One session's caches: what an operation on behalf of that session may see and change."""

    def __init__(self, store: CacheStore, session_id: str) -> None:
        self._store = store
        self.session_id = session_id

    def get(self, cache_id: str | None) -> CacheState:
        """The named cache's state; CacheNotFound when it was never created, is released, or is another
        session's."""
        state = self._store._get(self.session_id, cache_id or "")
        if state is None:
            raise CacheNotFound(cache_id or "")
        return state

    def __getitem__(self, cache_id: str) -> CacheState:
        return self.get(cache_id)

    def __contains__(self, cache_id: object) -> bool:
        return isinstance(cache_id, str) and self._store._get(self.session_id, cache_id) is not None

    def __len__(self) -> int:
        return len(self._store._ids(self.session_id))

    def __iter__(self) -> Iterator[str]:
        return iter(self._store._ids(self.session_id))

    def add(self, state: CacheState) -> str:
        """Names a cache created by a successful forward; it belongs to this table's session."""
        return self._store._add(self.session_id, state)

    def pop(self, cache_id: str) -> CacheState | None:
        return self._store._pop(self.session_id, cache_id)

    def ref(self, cache_id: str) -> CacheRef:
        state = self._store._get(self.session_id, cache_id)
        return CacheRef(cache_id, state.table.length if state else 0)
