"""One step of the executor over a session's caches: plan the items (request_validation.py), run the valid
ones in one packed forward (executor_service/step/batch.py), and commit what it produced: new caches get their ids, sampling that
items sent is registered with their caches, the blocks the forward filled join the prefix cache (then, for a
model whose every layer slides, the blocks that left each sequence's window are freed), counters move. An
item wrong on its own fails alone (its result's error, nothing of it written); a failure of the forward itself
leaves every cache as it was (BatchRunner puts them back) and raises. ForwardVerify frees nothing of the
window: its caller may truncate back over the verified tokens. The prompt logprobs a filled block's
positions got are stored beside it in the prefix cache (executor_service/kv/prompt_logprob_store.py).

The executor calls it under its model lock, with the caches of the operation's session."""
from __future__ import annotations

import time
from typing import Sequence

import torch

from executor_service.adapters import AdapterRegistry
from executor_service.step.batch import BatchRunner, PlannedItem
from executor_service.step.model_drafts import ModelDrafts
from executor_service.kv.cache_table import CacheState, CacheTable
from executor_service.metrics.op_stats import ExecutorMetrics
from executor_service.kv.prefix_cache import PrefixCache
from executor_service.request_validation import RequestValidator
from executor_service.types import CacheRef, SequenceOutput, TokenOutput, UnifiedItem, UnifiedResult
from tandem.errors import TandemError
from tandem.sampling_params import SamplingParams


class BatchStep:
    def __init__(self, runner: BatchRunner, validator: RequestValidator, prefix: PrefixCache,
                 adapters: AdapterRegistry, metrics: ExecutorMetrics, drafts: ModelDrafts | None = None) -> None:
        """drafts: the draft model's guesses for items that ask (--draft-model); None: no draft model."""
        self.runner = runner
        self.drafts = drafts
        self.draft_seconds = 0.0  # time the last run() spent in the draft model
        self.validator = validator
        self.prefix = prefix
        self.adapters = adapters
        self.metrics = metrics

    def run(self, items: Sequence[UnifiedItem], caches: CacheTable) -> list[UnifiedResult]:
        """The items' results in order. Raises only for the call as a whole (no items, over the batch
        limits, KV pool full, device out of memory), and then nothing was written."""
        planned = self.validator.batch(items, caches)
        ok = [p for p in planned if isinstance(p, PlannedItem)]
        # A new cache takes its item's adapter and sampling (an existing one's adapter is validated equal).
        batch = [p if p.state is not None
                 else PlannedItem(p.item, self.new_state(p.item.adapter, sampling=p.sampling), p.sampling) for p in ok]
        outputs: list[list[SequenceOutput] | None] = []
        scored: list[list[TokenOutput]] = []
        pooled: list[torch.Tensor | None] = []
        drafted = [0] * len(batch)
        self.draft_seconds = 0.0
        if batch:  # reserves KV first; on any error puts every cache back and re-raises
            kind = _step_kind(batch)  # (before the run: it marks prompts done)
            if self.drafts is not None:  # the draft model's guesses become draft_token_ids (model_drafts.py)
                batch, drafted = self.drafts.attach(batch)
                self.draft_seconds = self.drafts.last_seconds
            start = time.perf_counter()
            outputs, scored, pooled = self.runner.run(batch, adapters=lambda: self._adapter_weights(batch))
            self.metrics.record_step(kind, time.perf_counter() - start, sum(len(b.item.token_ids) for b in batch))
            if self.drafts is not None:
                self.drafts.settle(batch, drafted, outputs)
            self._count(outputs, batch)
            for b in batch:  # a sliding-window model frees the blocks that left each window (kv_cache.py)
                self.runner.kv.slide(b.state.table)
        ran = iter(zip(batch, outputs, scored, pooled, drafted))
        results = []
        for item, p in zip(items, planned):
            if not isinstance(p, PlannedItem):
                results.append(UnifiedResult(caches.ref(item.cache_id or ""), None, p))
                continue
            b, outs, plp, vec, n_drafted = next(ran)
            if item.sampling is not None and item.pooling is None:
                b.state.sampling = item.sampling  # registered once the item succeeded
            results.append(UnifiedResult(self._register(p, b.state, caches), outs[0] if outs else None,
                                         prompt_logprobs=plp, pooled=vec, model_draft_tokens=n_drafted))
        return results

    def verify(self, item: UnifiedItem, caches: CacheTable) -> list[SequenceOutput]:
        """ForwardVerify's forward: writes the item's tokens to its (existing) cache and returns the greedy
        prediction after every one of them. Raises the item's error (it is the call's)."""
        (planned,) = self.validator.batch([item], caches)
        if isinstance(planned, TandemError):
            raise planned
        # Predictions are greedy, whatever sampling the cache has registered (which stays registered).
        batch = [PlannedItem(item, planned.state, SamplingParams())]
        start = time.perf_counter()
        outputs, _, _ = self.runner.run(batch, all_positions=True, adapters=lambda: self._adapter_weights(batch))
        self.metrics.record_step("verify", time.perf_counter() - start, len(item.token_ids))
        self._count(outputs, batch)
        self.metrics.tokens_processed += len(item.token_ids)
        return outputs[0] or []

    def new_state(self, adapter: str, cache_salt: str = "", sampling: SamplingParams = SamplingParams()) -> CacheState:
        root = self.prefix.root(adapter, self.adapters.digest(adapter), cache_salt)
        return CacheState(adapter=adapter, sampling=sampling, root=root)

    def _adapter_weights(self, batch: list[PlannedItem]) -> dict:
        names = {b.item.adapter for b in batch if b.item.adapter}
        for b in batch:
            if b.item.adapter:
                self.adapters.count_request(b.item.adapter)
        if not names:
            return {}
        moves = self.adapters.moves
        weights = self.adapters.on_device(names)
        if self.adapters.moves != moves:  # weights moved in or out: stacked copies may hold stale tensors
            self.runner.lora_stacks.clear()
        return weights

    def _count(self, outputs: list[list[SequenceOutput] | None], batch: list[PlannedItem]) -> None:
        """After a successful forward: counters, and the blocks it filled join the prefix cache."""
        for b in batch:
            sealed = len(b.state.table.hashes)
            self.prefix.seal(b.state.table, b.state.tokens, b.state.root, b.state.adapter, b.state.images)
            self._store_logprobs(b.state, sealed)
        self.metrics.forward_passes += 1
        self.metrics.tokens_sampled += sum(len(o.tokens) for outs in outputs if outs for o in outs)

    def _store_logprobs(self, state: CacheState, sealed: int) -> None:
        """Stores, beside each block sealed since `sealed` (a count of hashes) that the cache's trail covers, its
        prompt logprobs and last hidden state (only while its hash is indexed: the store follows the index);
        then the trail keeps only the partial last block."""
        trail = state.plp_trail
        if trail is None:
            return
        bs = self.runner.kv.block_size
        for i in range(sealed, len(state.table.hashes)):
            got = trail.block(i, bs)
            h = state.table.hashes[i]
            if got is not None and self.runner.kv.allocator.lookup([h]):
                self.prefix.logprobs.put(h, *got)
        state.plp_trail = trail.after_sealing(state.table.length, bs)

    def _register(self, planned: PlannedItem, state: CacheState, caches: CacheTable) -> CacheRef:
        """Names a cache created by a successful forward (ids are only handed out once state exists)."""
        if planned.state is not None:
            cache_id = planned.item.cache_id or ""
        else:
            cache_id = caches.add(state)
            self.metrics.caches_created += 1
        self.metrics.tokens_processed += len(planned.item.token_ids)
        return CacheRef(cache_id, state.table.length)


def _step_kind(batch: list[PlannedItem]) -> str:
    """prefill: every item writes prompt tokens; decode: every item's cache is past its prompt; else mixed."""
    decodes = sum(b.state.prompt_len is not None for b in batch)
    return "decode" if decodes == len(batch) else "prefill" if not decodes else "mixed"
