"""Every check a batch of items must pass before the executor touches any state: request rules (tokens,
vocabulary, sampling, output options, length, per-call limits) and the cache table (ids, positions,
adapters). It mutates nothing; a batch that passes may still meet a full KV pool (checked when reserving)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from executor_service.adapters import AdapterRegistry
from executor_service.cache_table import CacheState, CacheTable
from executor_service.types import UnifiedItem
from models.config import ModelConfig
from tandem.errors import CacheStateConflict, InvalidRequest, PositionMismatch, SequenceTooLong

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class PlannedItem:
    item: UnifiedItem
    state: CacheState | None  # None: a new cache


class RequestValidator:
    def __init__(self, model_config: ModelConfig, max_batch_tokens: int, adapters: AdapterRegistry) -> None:
        self.vocab_size = model_config.vocab_size
        self.max_len = model_config.max_position_embeddings
        self.max_batch_tokens = max_batch_tokens
        self.adapters = adapters

    def batch(self, items: Sequence[UnifiedItem], caches: CacheTable) -> list[PlannedItem]:
        """Checks the whole batch; raises the first error (a domain error naming the item), else returns each
        item with its cache's state."""
        if not items:
            raise InvalidRequest("the batch has no items")
        total = sum(len(it.token_ids) for it in items)
        if total > self.max_batch_tokens:
            raise InvalidRequest(f"the batch carries {total} tokens; this executor takes at most "
                                 f"{self.max_batch_tokens} per call (--max-batch-tokens): split it into chunks")
        seen: set[str] = set()
        planned = [self._item(n, it, caches, seen) for n, it in enumerate(items)]
        used = {it.adapter for it in items if it.adapter}
        if len(used) > self.adapters.max_on_device:
            raise InvalidRequest(f"the batch uses {len(used)} adapters but at most {self.adapters.max_on_device} fit "
                                 "on the device at once (--max-adapters-on-device): split the batch")
        return planned

    def _item(self, n: int, it: UnifiedItem, caches: CacheTable, seen: set[str]) -> PlannedItem:
        where = f"item {n}" + (f" (cache {it.cache_id!r})" if it.cache_id else "")
        if not it.token_ids:
            raise InvalidRequest(f"{where}: token_ids is empty")
        bad = next((t for t in it.token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{where}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if it.adapter:
            self.adapters.get(it.adapter)  # AdapterNotFound
        it.sampling.validate(self.vocab_size)
        if not 0 <= it.output.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"{where}: top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        state = None
        if it.cache_id:
            if it.cache_id in seen:
                raise InvalidRequest(f"cache {it.cache_id!r} appears twice in one batch")
            seen.add(it.cache_id)
            state = caches.get(it.cache_id)
            if state.adapter != it.adapter:
                raise CacheStateConflict(f"{where}: the cache was created with adapter {state.adapter or '(base)'!r};"
                                         f" it cannot continue with {it.adapter or '(base)'!r} (its KV depends "
                                         "on the adapter)")
            if it.pos_offset != state.table.length:
                raise PositionMismatch(f"{where}: position {it.pos_offset} (pos_offset / cache.seq_len) but the "
                                       f"cache holds {state.table.length} tokens; send the tokens for position "
                                       f"{state.table.length} next")
        elif it.pos_offset != 0:
            raise InvalidRequest(f"{where}: a new cache (empty cache_id) starts at pos_offset 0, got {it.pos_offset}")
        end = it.pos_offset + len(it.token_ids)
        if it.is_final_chunk and it.prompt_len is not None and it.prompt_len > end:
            raise InvalidRequest(f"{where}: prompt_len {it.prompt_len} exceeds the {end} tokens the cache will hold "
                                 "after this item")
        if end > self.max_len:
            raise SequenceTooLong(f"{where}: {it.pos_offset} + {len(it.token_ids)} tokens exceed the model's "
                                  f"maximum length of {self.max_len}")
        return PlannedItem(it, state)
