"""Decode with num_steps > 1: each step one packed forward over the items still going, feeding each sampled
token back, with the executor's failure rules across steps (an item's own error takes back its earlier
steps; any other failure takes back every step; a pool that fills after the first step ends the call with
partial results)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from executor_service.cache_table import CacheTable
from executor_service.request_validation import RequestValidator, name_item
from executor_service.types import DecodeItem, DecodeResult, SequenceOutput, UnifiedItem, UnifiedResult
from models.kv_cache import PagedKvCache
from tandem.errors import InvalidRequest, KvCapacityExceeded, TandemError

MAX_DECODE_STEPS = 256


def run_decode_steps(items: Sequence[DecodeItem], num_steps: int, caches: CacheTable, kv: PagedKvCache,
                     validator: RequestValidator, run: Callable[[list[UnifiedItem]], list[UnifiedResult]],
                     max_len: int) -> list[DecodeResult]:
    """The executor's decode, under its model lock. run: one packed forward over unified items."""
    steps = max(1, num_steps)
    if steps > MAX_DECODE_STEPS:
        raise InvalidRequest(f"num_steps must be <= {MAX_DECODE_STEPS}, got {num_steps}")
    if not items:
        raise InvalidRequest("decode needs at least one item")
    validator.check_call([UnifiedItem((it.token_id,), draft_token_ids=it.draft_token_ids) for it in items])
    errors: list[TandemError | None] = [None] * len(items)
    for n, it in enumerate(items):
        if not it.cache.cache_id:  # a Decode extends caches; it never creates one
            errors[n] = name_item(InvalidRequest("a decode item needs the cache_id of an existing cache "
                                                 "(prefill first)"), n)
        elif steps > 1 and not it.output.wants_tokens:
            errors[n] = name_item(InvalidRequest("num_steps > 1 feeds sampled tokens back: output mode "
                                                 "must include tokens"), n, it.cache.cache_id)
        elif steps > 1 and it.draft_token_ids:
            errors[n] = name_item(InvalidRequest("draft tokens are verified in one step: send them with "
                                                 "num_steps 0 or 1 (or use UnifiedDecode)"), n, it.cache.cache_id)
    # Before the first step: what to put back if a later step fails.
    before = {n: caches[it.cache.cache_id].snapshot() for n, it in enumerate(items)
              if it.cache.cache_id in caches}
    outputs = [SequenceOutput() for _ in items]
    active = [n for n in range(len(items)) if errors[n] is None]
    tokens = [it.token_id for it in items]
    for step in range(steps):
        if not active:
            break
        batch = [UnifiedItem((tokens[i],), items[i].cache.cache_id,
                             items[i].cache.seq_len if step == 0 else caches[items[i].cache.cache_id]
                             .table.length, True, items[i].sampling, items[i].output, items[i].adapter,
                             draft_token_ids=items[i].draft_token_ids if steps == 1 else ())
                 for i in active]
        try:
            results = run(batch)
        except KvCapacityExceeded:
            if step == 0:
                raise
            break  # the pool filled: the steps taken stand (partial results)
        except BaseException:
            for snap in before.values():  # earlier steps wrote: take them back (a no-op for the others)
                snap.restore(kv)
            raise
        still = []
        for i, res in zip(active, results):
            if res.error is not None:  # an item's own error: it fails alone, with nothing written
                if step:
                    before[i].restore(kv)
                    outputs[i] = SequenceOutput()
                errors[i] = res.error
                continue
            outputs[i].tokens.extend(res.output.tokens)
            if res.output.logits is not None:
                prev = outputs[i].logits
                outputs[i].logits = res.output.logits if prev is None else torch.cat([prev, res.output.logits])
            sampled = res.output.tokens[0].token_id if res.output.tokens else None
            if sampled is not None and sampled not in items[i].stop_token_ids and res.cache.seq_len < max_len:
                tokens[i] = sampled
                still.append(i)
        active = still
    return [DecodeResult(caches.ref(it.cache.cache_id), SequenceOutput() if err else out, err)
            for it, out, err in zip(items, outputs, errors)]

