"""A prompt whose every block is in the prefix cache (its length a multiple of the block size) reuses all but
its last token, in process on the tiny llama: CreateCache answers length - 1, the next call computes one token
(into a private copy of the shared last block), its logits and the decode after it are those of a cold run,
the indexed block is never changed for the caches that share it, and a prompt asking for prompt logprobs still
reuses whole blocks only (their stored logprobs are kept per block)."""
from __future__ import annotations

import pytest

from executor_service.types import CacheRef, CreateCacheItem, DecodeItem, UnifiedItem
from tests.executor.test_prefix_cache_sharing import TOL, assert_all_back, prompt_of
from tests.executor_driver import LOGITS, greedy_run, make_executor, raising, warm_prefixes
from tests.hf_reference import rel_err

BS = 16


@pytest.fixture(scope="module")
def off(model_dir):
    return make_executor(model_dir, prefix_caching=False)


def test_a_fully_cached_prompt_computes_only_its_last_token(model_dir, off):
    ex = make_executor(model_dir)
    p = prompt_of(4 * BS, seed=21)
    _, want, want_logits = greedy_run(off, p, 4)
    warm_prefixes(ex, [p])
    stats = ex.prefix_stats()
    # Two caches of the same prompt: both hold the 4 indexed blocks, the last one short of its last token.
    created = raising(ex.create_caches([CreateCacheItem(tuple(p)), CreateCacheItem(tuple(p))]))
    assert [(c.cached_tokens, c.cache.seq_len) for c in created] == [(4 * BS - 1, 4 * BS - 1)] * 2
    assert ex.prefix_stats().hit_tokens - stats.hit_tokens == 2 * (4 * BS - 1)
    for c in created:  # each writes the last token into its own copy of the shared block
        cache_id, tokens, logits = greedy_run_from(ex, p, c.cache.cache_id, 4)
        assert tokens == want and all(rel_err(a, b) < TOL for a, b in zip(logits, want_logits))
    assert ex.prefix_stats().copied_blocks - stats.copied_blocks == 2
    ex.release_cache([c.cache.cache_id for c in created])
    # the indexed block was never written: a third cache still reuses it and gets the same answer
    (again,) = raising(ex.create_caches([CreateCacheItem(tuple(p))]))
    assert again.cached_tokens == 4 * BS - 1
    _, tokens, _ = greedy_run_from(ex, p, again.cache.cache_id, 4)
    assert tokens == want
    ex.release_cache([again.cache.cache_id])
    assert_all_back(ex)


def test_not_every_block_cached_or_prompt_logprobs_reuse_whole_blocks(model_dir):
    ex = make_executor(model_dir)
    p = prompt_of(4 * BS, seed=22)
    warm_prefixes(ex, [p[:3 * BS + 5]])  # blocks 0..2 indexed, not block 3
    (partial,) = raising(ex.create_caches([CreateCacheItem(tuple(p))]))
    assert partial.cached_tokens == 3 * BS
    unaligned = p + [7]  # its last block is partial: only whole blocks, as before
    warm_prefixes(ex, [p])
    (whole, odd) = raising(ex.create_caches([CreateCacheItem(tuple(p), prompt_logprobs=0),
                                              CreateCacheItem(tuple(unaligned))]))
    assert whole.cached_tokens == 0  # nothing stored with prompt logprobs: nothing reused
    assert odd.cached_tokens == 4 * BS
    ex.release_cache([partial.cache.cache_id, whole.cache.cache_id, odd.cache.cache_id])
    assert_all_back(ex)


def greedy_run_from(ex, prompt: list[int], cache_id: str, steps: int):
    """greedy_run's decode after writing the prompt's last token into a cache holding the rest."""
    (res,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt[-1:]), cache_id, len(prompt) - 1, output=LOGITS)]))
    assert res.cache.seq_len == len(prompt)
    tokens, logits = [res.output.tokens[0].token_id], [res.output.logits[0]]
    for _ in range(steps - 1):
        (d,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, len(prompt) + len(tokens) - 1), tokens[-1],
                                             output=LOGITS)]))
        tokens.append(d.output.tokens[0].token_id)
        logits.append(d.output.logits[0])
    return cache_id, tokens, logits
