"""Items that asked for model drafts (UnifiedItem.model_draft_tokens) get them before the step's forward: how
many each may take (the call's max_batch_tokens, the model's length, the served model's free KV blocks beside
what the call's own tokens need), the draft model's guesses (executor_service/step/draft_model.py) turned into
the item's draft_token_ids, and after the forward the draft caches kept to what was accepted.

Room is decided here so that drafts never fail a call that would run without them: an item whose guesses would
not fit gets fewer, or none.
"""
from __future__ import annotations

import time
from dataclasses import replace

from executor_service.step.batch import PlannedItem
from executor_service.step.draft_model import DraftModel
from executor_service.types import SequenceOutput
from models.kv.paged_cache import PagedKvCache
from tandem.ceil_div import ceil_div


class ModelDrafts:
    def __init__(self, draft: DraftModel, kv: PagedKvCache, max_batch_tokens: int, max_len: int) -> None:
        """kv, max_batch_tokens, max_len: the served model's pool and limits."""
        self.draft = draft
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_len = max_len
        self.last_seconds = 0.0  # time the last attach() spent running the draft model

    def attach(self, batch: list[PlannedItem]) -> tuple[list[PlannedItem], list[int]]:
        """The batch with each asking item's guesses as its draft_token_ids, and per item how many it got."""
        self.last_seconds = 0.0
        asking = [i for i, b in enumerate(batch) if b.item.model_draft_tokens]
        drafted = [0] * len(batch)
        if not asking:
            return batch, drafted
        bs = self.kv.block_size
        budget = self.max_batch_tokens - sum(len(b.item.token_ids) + len(b.item.draft_token_ids) for b in batch)
        spare = self.kv.allocator.num_free - sum(self.kv.blocks_needed(
            b.state.table, b.state.table.length + len(b.item.token_ids) + len(b.item.draft_token_ids)) for b in batch)
        wants, where = [], []
        for i in asking:
            b = batch[i]
            end = b.state.table.length + len(b.item.token_ids)
            # tokens the blocks it will hold anyway, and the spare ones, have room for after its own
            room = (ceil_div(end, bs) + max(spare, 0)) * bs - end
            n = min(b.item.model_draft_tokens, budget, self.max_len - end, room)
            if n <= 0:
                continue
            budget -= n
            spare -= ceil_div(end + n, bs) - ceil_div(end, bs)
            wants.append((b.state, b.item.token_ids, n))
            where.append(i)
        if not wants:
            return batch, drafted
        start = time.perf_counter()
        guesses = self.draft.propose(wants)
        self.last_seconds = time.perf_counter() - start
        out = list(batch)
        for i, g in zip(where, guesses):
            if g:
                out[i] = replace(batch[i], item=replace(batch[i].item, draft_token_ids=g))
                drafted[i] = len(g)
        return out, drafted

    def settle(self, batch: list[PlannedItem], drafted: list[int],
               outputs: list[list[SequenceOutput] | None]) -> None:
        """After the forward: each drafting item's draft cache keeps what its served cache kept."""
        for b, n, outs in zip(batch, drafted, outputs):
            if n:
                accepted = max(0, len(outs[0].tokens) - 1) if outs else 0
                self.draft.settle(b.state, accepted)
