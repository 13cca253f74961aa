"""The draft model (--draft-model): a smaller model of the same vocabulary, in this process and on this device,
whose greedy guesses become an item's draft tokens (UnifiedItem.model_draft_tokens) for the served model to
verify in the same forward as draft_token_ids (executor_service/step/batch.py: the output is exactly the one of
one token per step, whatever the guesses).

It keeps one *draft cache* per cache of the served model that drafts, in its own KV pool (its own ModelStack,
built by executor_service/draft_model_stack.py), keyed by the served cache's state object (weakly: a state that is
gone leaves an entry that is stale and is reclaimed first). The served cache's tokens (CacheState.tokens) are the
truth: before drafting, the draft cache keeps its longest common prefix with them (a truncation, a rollback or a
preemption-recompute of the served cache shows up there) and catches up with the rest, in chunks of at most
max_batch_tokens; then N - 1 single-token steps, batched over the items that asked, give N greedy guesses. After
verification the draft cache keeps only what the served cache kept (settle). Nothing of a draft cache ever
travels (KV export, tiers): a cache imported elsewhere drafts again from a lazily recomputed draft cache.

Capacity never fails an item: a draft cache that does not fit evicts the least recently used others, and when it
still does not fit, the item gets no drafts (DraftStats.items_without_drafts). A draft model error (a device OOM)
drops the call's drafts and their draft caches, logged; the served model's forward runs without them.

Runs under the executor's model lock (every caller holds it), so it needs no lock of its own; GetInfo reads the
counters (plain ints) without one.
"""
from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from executor_service.kv.cache_table import CacheState
from executor_service.model_stack import ModelStack
from executor_service.step.batch import BatchRunner, PlannedItem
from executor_service.types import DraftModelInfo, UnifiedItem
from models.kv.paged_cache import PagedKvCache
from tandem.errors import TandemError
from tandem.sampling_params import SamplingParams

log = logging.getLogger("tandem.executor")

_GREEDY = SamplingParams()  # temperature 0: the draft model's argmax
SHORT_CATCH_UP = 4  # pending tokens up to this many are fed one per forward (see DraftModel._catch_up)


@dataclass
class DraftStats:
    """Counters since start (GetInfoResponse.draft_model)."""

    caches_freed: int = 0
    caches_evicted: int = 0
    items_without_drafts: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    catch_up_tokens: int = 0
    seconds: float = 0.0


@dataclass
class _DraftCache:
    owner: weakref.ref  # the served cache's CacheState
    state: CacheState = field(default_factory=CacheState)  # its blocks in the draft pool and the tokens it holds


@dataclass
class _Drafting:
    """One item of a propose() call: its draft cache, the tokens still to write to it, the guesses so far."""

    index: int
    cache: _DraftCache
    pending: list[int]
    wanted: int
    guesses: list[int] = field(default_factory=list)


class DraftModel:
    def __init__(self, name: str, stack: ModelStack, max_batch_tokens: int) -> None:
        """stack: the draft model's own (its batch runner and KV pool); max_batch_tokens: most tokens per forward."""
        self.name = name
        self.stack = stack
        self.runner: BatchRunner = stack.runner
        self.kv: PagedKvCache = stack.kv
        self.max_len = stack.model_config.max_position_embeddings
        self.max_batch_tokens = max_batch_tokens
        self.stats = DraftStats()
        self._caches: OrderedDict[int, _DraftCache] = OrderedDict()  # id(served state) -> its draft cache, LRU first

    @property
    def live_caches(self) -> int:
        return len(self._caches)

    def propose(self, wants: Sequence[tuple[CacheState, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """Per (served cache, the tokens the item writes after the cache's, guesses wanted): up to that many
        greedy guesses of the tokens that follow (fewer or none: the draft model's length, or its pool)."""
        start = time.perf_counter()
        drafts: list[tuple[int, ...]] = [()] * len(wants)
        busy: set[int] = set()
        live: list[_Drafting] = []
        for i, (state, new, n) in enumerate(wants):
            end = len(state.tokens) + len(new)
            n = min(n, self.max_len - end + 1)  # guesses 1..n-1 are written at end .. end + n - 2
            if n <= 0:
                continue
            dc = self._cache_for(state)
            busy.add(id(state))
            keep = min(_common_prefix(dc.state.tokens, state.tokens, new), end - 1)  # (at least one token to feed)
            self._truncate(dc, keep)
            if not self._reserve(dc, end + n - 1, busy):
                self.stats.items_without_drafts += 1
                continue
            held = len(state.tokens)
            pending = state.tokens[keep:] + list(new) if keep < held else list(new[keep - held:])
            live.append(_Drafting(i, dc, pending, n))
        try:
            self._catch_up(live)
            self._guess(live)
        except (TandemError, RuntimeError) as exc:  # (a device OOM is a RuntimeError): draft nothing this call
            log.warning("the draft model failed (%s); this call's items run without drafts", exc)
            for d in live:
                self._drop(id(d.cache.owner()), None)
            self.stats.items_without_drafts += len(live)
            live = []
        for d in live:
            drafts[d.index] = tuple(d.guesses)
            self.stats.draft_tokens += len(d.guesses)
        self.stats.seconds += time.perf_counter() - start
        return drafts

    def settle(self, state: CacheState, accepted: int) -> None:
        """After verification: the draft cache keeps what the served cache kept (its tokens and the accepted
        guesses; the rejected guesses it wrote go back to the pool)."""
        self.stats.accepted_draft_tokens += accepted
        dc = self._caches.get(id(state))
        if dc is not None and dc.owner() is state:
            self._truncate(dc, min(len(dc.state.tokens), len(state.tokens)))

    def free(self, state: CacheState) -> None:
        """The served cache was freed: so is its draft cache."""
        dc = self._caches.get(id(state))
        if dc is not None and dc.owner() is state:
            self._drop(id(state), "caches_freed")

    # ----------------------------------------------------------------- internals
    def _cache_for(self, state: CacheState) -> _DraftCache:
        key = id(state)
        dc = self._caches.get(key)
        if dc is not None and dc.owner() is not state:  # a dead state's entry whose id was reused
            self._drop(key, "caches_evicted")
            dc = None
        if dc is None:
            dc = self._caches[key] = _DraftCache(weakref.ref(state))
        self._caches.move_to_end(key)
        return dc

    def _reserve(self, dc: _DraftCache, length: int, busy: set[int]) -> bool:
        """Blocks for `length` tokens in dc's table, evicting the least recently used draft caches not in this
        call (busy) while the pool is short; False (and dc dropped) when even that does not make room."""
        need = self.kv.blocks_needed(dc.state.table, length)
        while not self.kv.allocator.can_allocate(need):
            victim = next((k for k in self._caches if k not in busy), None)
            if victim is None:
                self._drop(id(dc.owner()), None)
                return False
            self._drop(victim, "caches_evicted")
        self.kv.reserve([(dc.state.table, length)])
        return True

    def _catch_up(self, live: list[_Drafting]) -> None:
        """Writes each item's pending tokens; the forward of an item's last ones gives its first guess. A few
        pending tokens (the usual case after a verification: the last accepted guess and the token sampled after
        it) go one per forward, batched over the items, where the decode step runs them (native, CUDA graphs:
        measured on 2 CPU cores, two single-token native steps of SmolLM2-135M take a fraction of one eager
        2-token forward); longer ones in chunks of at most max_batch_tokens through the eager forward."""
        self._feed_singly([d for d in live if 0 < len(d.pending) <= SHORT_CATCH_UP])
        queue = [d for d in live if len(d.pending) > SHORT_CATCH_UP]
        while queue:
            budget, batch, rest = self.max_batch_tokens, [], []
            for d in queue:
                if budget <= 0:
                    rest.append(d)
                    continue
                chunk, d.pending = d.pending[:budget], d.pending[budget:]
                batch.append((d, PlannedItem(UnifiedItem(tuple(chunk), is_final_chunk=not d.pending),
                                             d.cache.state, _GREEDY)))
                budget -= len(chunk)
                self.stats.catch_up_tokens += len(chunk)
                if d.pending:
                    rest.append(d)
            outputs, _, _ = self.runner.run([p for _, p in batch])
            for (d, _), out in zip(batch, outputs):
                if out:  # (a final chunk: its last position's greedy token)
                    d.guesses.append(out[0].tokens[0].token_id)
            queue = rest

    def _feed_singly(self, live: list[_Drafting]) -> None:
        while True:
            going = [d for d in live if d.pending]
            if not going:
                return
            self.stats.catch_up_tokens += len(going)
            outputs, _, _ = self.runner.run([PlannedItem(UnifiedItem((d.pending.pop(0),)), d.cache.state, _GREEDY)
                                             for d in going])
            for d, out in zip(going, outputs):
                if not d.pending:
                    d.guesses.append(out[0].tokens[0].token_id)

    def _guess(self, live: list[_Drafting]) -> None:
        """Feeds each item's latest guess until it has as many as it wanted: one batched forward per guess."""
        while True:
            going = [d for d in live if len(d.guesses) < d.wanted]
            if not going:
                return
            outputs, _, _ = self.runner.run([PlannedItem(UnifiedItem((d.guesses[-1],)), d.cache.state, _GREEDY)
                                             for d in going])
            for d, out in zip(going, outputs):
                d.guesses.append(out[0].tokens[0].token_id)

    def _truncate(self, dc: _DraftCache, length: int) -> None:
        if length < dc.state.table.length or length < len(dc.state.tokens):
            self.kv.truncate(dc.state.table, length)
            dc.state.truncate(length)

    def _drop(self, key: int, counter: str | None) -> None:
        """Releases a draft cache's blocks; counter: the DraftStats field that counts why (None: no count)."""
        dc = self._caches.pop(key, None)
        if dc is None:
            return
        self.kv.release(dc.state.table)
        if counter is not None:
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)


def _common_prefix(held: list[int], tokens: list[int], new: Sequence[int]) -> int:
    """Length of the longest common prefix of `held` and tokens + new (without building the concatenation
    in the usual case, where held is a prefix of tokens)."""
    n = len(held)
    if n <= len(tokens) and held == tokens[:n]:
        return n
    full = tokens + list(new)
    n = min(n, len(full))
    for i in range(n):
        if held[i] != full[i]:
            return i
    return n


def draft_model_info(draft: DraftModel) -> DraftModelInfo:
    """GetInfo's view of the draft model: what it is, its pool, its counters."""
    cfg, s = draft.stack.model_config, draft.stats
    return DraftModelInfo(model_id=draft.name, architecture=cfg.checkpoint_architecture or cfg.architecture,
                          num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, kv_pool=draft.stack.kv_pool,
                          free_blocks=draft.kv.allocator.num_free, live_caches=draft.live_caches,
                          caches_freed=s.caches_freed, caches_evicted=s.caches_evicted,
                          items_without_drafts=s.items_without_drafts, draft_tokens=s.draft_tokens,
                          accepted_draft_tokens=s.accepted_draft_tokens, catch_up_tokens=s.catch_up_tokens,
                          draft_seconds=s.seconds)
