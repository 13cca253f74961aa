"""Decode with num_steps > 1: each step one packed forward over the items still going, feeding each sampled
token back, with the executor's failure rules across steps (an item's own error takes back its earlier
steps; any other failure takes back every step; a pool that fills after the first step ends the call with
partial results).

Speculation within the burst (DecodeItem.ngram_drafts): before each step an item's draft comes from its own
tokens (executor_service/step/ngram_drafts.py) and rides that step's forward as UnifiedItem.draft_token_ids, which
executor_service/step/batch.py verifies exactly as one token per step would sample and rolls back where rejected. Here: drafts are
cut to the item's room (max_seq_len, max_tokens, the call's max_batch_tokens); a step whose drafts do not fit
the KV pool runs again without them; a stop token among the accepted drafts ends the item there, its cache
cut back to what plain decoding would have written."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from executor_service.kv.cache_table import CacheTable
from executor_service.step.ngram_drafts import DraftLength
from executor_service.request_validation import RequestValidator, name_item
from executor_service.types import DecodeItem, DecodeResult, SequenceOutput, UnifiedItem, UnifiedResult
from models.kv.paged_cache import PagedKvCache
from tandem.errors import InvalidRequest, KvCapacityExceeded, TandemError

MAX_DECODE_STEPS = 256


@dataclass
class _Drafting:
    length: DraftLength
    steps: int = 0  # steps that carried drafts
    drafted: int = 0
    accepted: int = 0


def run_decode_steps(items: Sequence[DecodeItem], num_steps: int, caches: CacheTable, kv: PagedKvCache,
                     validator: RequestValidator, run: Callable[[list[UnifiedItem]], list[UnifiedResult]],
                     max_len: int) -> list[DecodeResult]:
    """The executor's decode, under its model lock. run: one packed forward over unified items."""
    steps = max(1, num_steps)
    if steps > MAX_DECODE_STEPS:
        raise InvalidRequest(f"{{field}} must be <= {MAX_DECODE_STEPS}, got {num_steps}", "num_steps")
    if not items:
        raise InvalidRequest("decode needs at least one item", "items")
    validator.check_call([UnifiedItem((it.token_id,), draft_token_ids=it.draft_token_ids) for it in items])
    errors: list[TandemError | None] = [_item_problem(it, n, steps) for n, it in enumerate(items)]
    # Before the first step: what to put back if a later step fails.
    before = {n: caches[it.cache.cache_id].snapshot() for n, it in enumerate(items)
              if it.cache.cache_id in caches}
    outputs = [SequenceOutput() for _ in items]
    caps = [it.max_tokens or steps for it in items]
    drafting = {n: _Drafting(DraftLength(it.ngram_drafts)) for n, it in enumerate(items)
                if it.ngram_drafts is not None and errors[n] is None}
    active = [n for n in range(len(items)) if errors[n] is None]
    tokens = [it.token_id for it in items]

    def batch_of(drafts: dict[int, tuple[int, ...]], step: int) -> list[UnifiedItem]:
        return [UnifiedItem((tokens[i],), items[i].cache.cache_id,
                            items[i].cache.seq_len if step == 0 else caches[items[i].cache.cache_id].table.length,
                            True, items[i].sampling, items[i].output, items[i].adapter,
                            # (exclusive: draft_token_ids come only with one step and no ngram_drafts)
                            draft_token_ids=items[i].draft_token_ids or drafts.get(i, ()))
                for i in active]

    for step in range(steps):
        if not active:
            break
        drafts = _drafts(items, active, drafting, caches, tokens, outputs, caps, step, max_len,
                         validator.max_batch_tokens) if drafting else {}
        try:
            try:
                results = run(batch_of(drafts, step))
            except KvCapacityExceeded:
                if not drafts:
                    raise
                drafts = {}  # maybe only the drafts did not fit: the step as plain decoding would run it
                results = run(batch_of(drafts, step))
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
            got = res.output.tokens
            stop = items[i].stop_token_ids
            if drafts.get(i):
                got = _verified(drafting[i], len(drafts[i]), got, stop, caches, items[i].cache.cache_id, kv)
            outputs[i].tokens.extend(got)
            if res.output.logits is not None:
                prev = outputs[i].logits
                outputs[i].logits = res.output.logits if prev is None else torch.cat([prev, res.output.logits])
            sampled = got[-1].token_id if got else None
            if (sampled is not None and sampled not in stop and len(outputs[i].tokens) < caps[i]
                    and caches[items[i].cache.cache_id].table.length < max_len):
                tokens[i] = sampled
                still.append(i)
        active = still
    results = []
    for n, (it, out, err) in enumerate(zip(items, outputs, errors)):
        d = drafting.get(n) if err is None else None
        results.append(DecodeResult(caches.ref(it.cache.cache_id), SequenceOutput() if err else out, err,
                                    *((d.steps, d.drafted, d.accepted) if d else ())))
    return results


def _item_problem(it: DecodeItem, n: int, steps: int) -> TandemError | None:
    """Why the item fails alone before any step (INVALID_ARGUMENT), or None."""
    problem, field = None, None
    if not it.cache.cache_id:  # a Decode extends caches; it never creates one
        return name_item(InvalidRequest("a decode item needs {field} of an existing cache (prefill first)",
                                        "cache.cache_id"), n)
    if steps > 1 and not it.output.wants_tokens:
        problem, field = "num_steps > 1 feeds sampled tokens back: output mode must include tokens", "output.mode"
    elif steps > 1 and it.draft_token_ids:
        problem, field = ("{field} are verified in one step: send them with num_steps 0 or 1 (or use "
                          "UnifiedDecode)", "draft_token_ids")
    elif it.ngram_drafts is not None:
        problem, field = it.ngram_drafts.problem() or (None, None)
        if problem is None and it.draft_token_ids:
            problem, field = "{field} and draft_token_ids exclude each other: send one of them", "ngram_drafts"
        elif problem is None and it.output.wants_logits:
            problem, field = ("ngram_drafts are verified by sampling them: the output mode must be tokens (no "
                              "logits)", "output.mode")
    return None if problem is None else name_item(InvalidRequest(problem, field), n, it.cache.cache_id)


def _drafts(items: Sequence[DecodeItem], active: list[int], drafting: dict[int, _Drafting], caches: CacheTable,
            tokens: list[int], outputs: list[SequenceOutput], caps: list[int], step: int, max_len: int,
            max_batch_tokens: int) -> dict[int, tuple[int, ...]]:
    """This step's draft per drafting item: as long as its draft length allows, and cut so that the cache
    stays within max_len, the item within its max_tokens and the step within max_batch_tokens."""
    budget = max_batch_tokens - len(active)
    out: dict[int, tuple[int, ...]] = {}
    for i in active:
        d, cache_id = drafting.get(i), items[i].cache.cache_id
        if d is None or budget < 1 or cache_id not in caches:
            continue
        state = caches[cache_id]
        pos = items[i].cache.seq_len if step == 0 else state.table.length
        if pos != len(state.tokens):  # a wrong position: the step fails the item on its own
            continue
        room = min(max_len - pos - 1, caps[i] - len(outputs[i].tokens) - 1, budget)
        draft = tuple(d.length.propose(state.tokens + [tokens[i]], room)) if room > 0 else ()
        if draft:
            out[i] = draft
            budget -= len(draft)
    return out


def _verified(d: _Drafting, drafted: int, got: list, stop: frozenset[int], caches: CacheTable, cache_id: str,
              kv: PagedKvCache) -> list:
    """A drafted step's tokens (the accepted drafts, then the token sampled after them), counted; when one of
    the accepted drafts is a stop token, only the tokens up to it, and the cache cut back to what one token per
    step would have written (the tokens before the stop token)."""
    accepted = len(got) - 1
    d.steps, d.drafted, d.accepted = d.steps + 1, d.drafted + drafted, d.accepted + accepted
    d.length.observe(drafted, accepted)
    k = next((k for k in range(accepted) if got[k].token_id in stop), None)
    if k is None:
        return got
    state = caches[cache_id]
    keep = state.table.length - (accepted - k)  # drops the stop token and the accepted drafts after it
    kv.truncate(state.table, keep)
    state.truncate(keep)
    return got[:k + 1]
