"""Sampling parameters registered with the cache: set at creation and by every item that sends
some; an item that sends none (UnifiedItem.sampling None, the proto's unset field) samples with the
registered ones. A failed item or call registers nothing."""
from __future__ import annotations

import random

from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from tandem.errors import InvalidRequest, PositionMismatch
from tandem.sampling_params import SamplingParams
from tests.executor_driver import make_executor

PROMPT = (5, 6, 7, 8)


def run(ex, first: SamplingParams, later: SamplingParams | None, steps: int) -> list[int]:
    """A new cache with `first`, then steps single-token items each sending `later` (None: nothing)."""
    (r,) = ex.unified_decode([UnifiedItem(PROMPT, sampling=first)])
    cid, tokens = r.cache.cache_id, [r.output.tokens[0].token_id]
    for _ in range(steps):
        (r,) = ex.unified_decode([UnifiedItem((tokens[-1],), cid, r.cache.seq_len, sampling=later)])
        assert r.error is None
        tokens.append(r.output.tokens[0].token_id)
    ex.release_cache([cid])
    return tokens


def test_a_large_logit_bias_sent_once_keeps_applying(model_dir):
    ex = make_executor(model_dir)
    vocab = ex.info().vocab_size
    rng = random.Random(0)
    # Most of the vocabulary banned, a few tokens pushed: far from the unbiased distribution.
    bias = {t: -100.0 for t in range(vocab) if t % 7}
    bias.update({t: rng.uniform(0, 5) for t in range(0, vocab, 7)})
    params = SamplingParams(temperature=0.8, top_k=40, seed=1234, logit_bias=bias)
    once = run(ex, params, None, 12)
    every_time = run(ex, params, params, 12)
    assert once == every_time
    assert all(t % 7 == 0 for t in once)  # the bias applied at every step
    assert run(ex, params, SamplingParams(), 12)[1:] != once[1:]  # sending other parameters replaces them


def test_a_new_cache_without_sampling_is_greedy(model_dir):
    ex = make_executor(model_dir)
    greedy = run(ex, SamplingParams(), SamplingParams(), 6)
    (r,) = ex.unified_decode([UnifiedItem(PROMPT)])  # sampling None on a new cache
    assert r.output.tokens[0].token_id == greedy[0]
    ex.release_cache([r.cache.cache_id])
    assert run(ex, SamplingParams(), None, 6) == greedy


def test_failed_items_and_verify_register_nothing(model_dir):
    ex = make_executor(model_dir)
    forced = SamplingParams(logit_bias={77: 100.0})
    (r,) = ex.unified_decode([UnifiedItem(PROMPT, sampling=forced)])
    cid, n = r.cache.cache_id, r.cache.seq_len
    # A failed item (wrong position) carrying other parameters: it fails alone and registers nothing.
    (bad,) = ex.unified_decode([UnifiedItem((77,), cid, n + 3, sampling=SamplingParams())])
    assert isinstance(bad.error, PositionMismatch)
    # Invalid parameters fail the item when sent; the registered ones are not re-checked afterwards.
    (bad,) = ex.unified_decode([UnifiedItem((77,), cid, n, sampling=SamplingParams(temperature=-1))])
    assert isinstance(bad.error, InvalidRequest)
    # forward_verify predicts greedily and leaves the registered parameters as they are.
    v = ex.forward_verify(CacheRef(cid, n), [77, 77])
    (r,) = ex.unified_decode([UnifiedItem((77,), cid, v.cache.seq_len)])
    assert r.output.tokens[0].token_id == 77
    # Decode items always send theirs (unset = greedy), which then register.
    (d,) = ex.decode([DecodeItem(CacheRef(cid, r.cache.seq_len), 77)])
    (after,) = ex.unified_decode([UnifiedItem((d.output.tokens[0].token_id,), cid, d.cache.seq_len)])
    greedy = ex.prefill(list(PROMPT) + [77] * 4 + [d.output.tokens[0].token_id])
    assert after.output.tokens[0].token_id == greedy.output.tokens[0].token_id
