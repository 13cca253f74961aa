"""Sliding windows that save memory: a model whose every layer slides (Mistral) keeps only the
blocks its next query's window reads; a model mixing sliding and full layers (Gemma 2) keeps them all. Parity
with transformers throughout, prefix caching over slid-out blocks, the refused truncation into freed blocks,
ForwardVerify + truncate, and the KvUsage accounting. On each device (tests/devices.py), against transformers on
the CPU in float32 within the device's dtype's tolerance (tests/device_tolerances.py)."""
from __future__ import annotations

import random

import pytest

from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from tandem.ceil_div import ceil_div
from tandem.errors import CacheStateConflict
from tests.device_tolerances import assert_logits_close, greedy_agreement
from tests.executor_driver import LOGITS, create_cache, make_executor, raising, warm_prefixes
from tests.hf_reference import HfReference

WINDOW = 32
BS = 16
BOUND = WINDOW // BS + 1  # the bound: window / block_size + 1 blocks


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


@pytest.fixture(scope="module")
def mistral(family_checkpoint):
    return family_checkpoint("mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hf(mistral):
    return HfReference(mistral)


def held(ex, cache_id: str) -> int:
    (listing,) = [c for s in ex.list_caches() for c in s.caches if c.cache_id == cache_id]
    return listing.blocks


def run_chunks(ex, prompt: list[int], chunk: int, after_each=None) -> tuple[str, object]:
    cache_id, pos, out = None, 0, None
    while pos < len(prompt):
        part = prompt[pos:pos + chunk]
        final = pos + len(part) == len(prompt)
        (res,) = raising(ex.unified_decode([UnifiedItem(tuple(part), cache_id, pos, final, output=LOGITS)]))
        cache_id, pos, out = res.cache.cache_id, pos + len(part), res.output
        if after_each:
            after_each(cache_id, pos)
    return cache_id, out


def test_a_sequence_four_windows_long_holds_at_most_window_over_block_size_plus_one(mistral, hf, device):
    ex = make_executor(mistral, kv_blocks=64, block_size=BS, device=device)
    assert ex.kv.window == WINDOW
    prompt = prompt_of(4 * WINDOW, seed=1)
    ref_tokens, ref_logits = hf.greedy(prompt, 24)
    peaks = []

    def check(cache_id: str, pos: int) -> None:
        peaks.append(held(ex, cache_id))
        usage = ex.kv_usage()
        assert usage.total_blocks - usage.free_blocks == peaks[-1]  # KvUsage counts what the cache holds

    cache_id, out = run_chunks(ex, prompt, BS, check)
    tokens, logits = [out.tokens[0].token_id], [out.logits[0]]
    for _ in range(23):
        (d,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, len(prompt) + len(tokens) - 1), tokens[-1],
                                             output=LOGITS)]))
        tokens.append(d.output.tokens[0].token_id)
        logits.append(d.output.logits[0])
        check(cache_id, 0)
    assert max(peaks) <= BOUND, peaks
    greedy_agreement(tokens, logits, ref_tokens, ref_logits, device.dtype, "mistral, 4 windows")
    assert ex.cache_length(cache_id) == len(prompt) + 23
    ex.release_cache([cache_id])
    assert ex.kv_usage().free_blocks == ex.kv_usage().total_blocks


def test_a_whole_prompt_in_one_chunk_is_freed_down_to_the_window_after_its_step(mistral, hf, device):
    ex = make_executor(mistral, kv_blocks=64, block_size=BS, device=device)
    prompt = prompt_of(4 * WINDOW, seed=2)
    res = ex.prefill(prompt, output=LOGITS)
    assert_logits_close(res.output.logits[0], hf.last_logits(prompt), device.dtype)
    assert held(ex, res.cache.cache_id) <= BOUND
    ex.release_cache([res.cache.cache_id])


def test_mixed_sliding_and_full_layers_keep_every_block(family_checkpoint, device):
    model_dir = family_checkpoint("gemma2")
    ex = make_executor(model_dir, kv_blocks=64, block_size=BS, device=device)
    assert ex.kv.window is None
    prompt = prompt_of(90, seed=3)
    res = ex.prefill(prompt, output=LOGITS)
    assert held(ex, res.cache.cache_id) == ceil_div(len(prompt), BS)
    assert_logits_close(res.output.logits[0], HfReference(model_dir).last_logits(prompt), device.dtype)
    ex.release_cache([res.cache.cache_id])


def test_prefix_cache_reuses_blocks_that_left_the_window(mistral, hf, device):
    """The warm run slid its first blocks out: freed but still indexed, they hold their prefix's K/V, so a
    later prompt adopts them (and slides them out again) and decodes exactly as transformers."""
    ex = make_executor(mistral, kv_blocks=64, block_size=BS, device=device)
    prompt = prompt_of(3 * WINDOW + 5, seed=4)
    warm_prefixes(ex, [prompt])
    cache_id, reused = create_cache(ex, prompt)
    assert reused == (len(prompt) - 1) // BS * BS
    res = ex.prefill(prompt[reused:], cache_id, output=LOGITS)
    assert_logits_close(res.output.logits[0], hf.last_logits(prompt), device.dtype)
    assert held(ex, cache_id) <= BOUND
    ex.release_cache([cache_id])
    assert ex.kv_usage().free_blocks == ex.kv_usage().total_blocks


def test_truncation_into_freed_blocks_is_refused_and_within_the_window_works(mistral, hf, device):
    ex = make_executor(mistral, kv_blocks=64, block_size=BS, device=device)
    prompt = prompt_of(3 * WINDOW, seed=5)
    res = ex.prefill(prompt)
    cache_id = res.cache.cache_id
    before = (held(ex, cache_id), ex.kv_usage().free_blocks)
    with pytest.raises(CacheStateConflict, match="sliding window"):
        ex.truncate_cache(cache_id, WINDOW)
    assert (held(ex, cache_id), ex.kv_usage().free_blocks) == before and ex.cache_length(cache_id) == len(prompt)
    keep = len(prompt) - 1  # the window of position keep is still held (96 - 31 = 65: block 4 on, as held)
    ex.truncate_cache(cache_id, keep)
    (d,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, keep), prompt[keep], output=LOGITS)]))
    assert_logits_close(d.output.logits[0], hf.last_logits(prompt[:keep + 1]), device.dtype)
    ex.release_cache([cache_id])


def test_forward_verify_then_truncate(mistral, hf, device):
    """ForwardVerify does not slide, so truncating back over the verified tokens stays possible."""
    ex = make_executor(mistral, kv_blocks=64, block_size=BS, device=device)
    prompt = prompt_of(2 * WINDOW + 7, seed=6)
    res = ex.prefill(prompt)
    draft = prompt_of(20, seed=7)
    v = ex.forward_verify(CacheRef(res.cache.cache_id, len(prompt)), draft, output=LOGITS)
    ref = hf.all_logits(prompt + draft)[len(prompt):]
    for k, (pos, r) in enumerate(zip(v.positions, ref)):
        assert_logits_close(pos.logits[0], r, device.dtype, f"draft position {k}")
    ex.truncate_cache(res.cache.cache_id, len(prompt) + 2)
    (d,) = raising(ex.decode([DecodeItem(CacheRef(res.cache.cache_id, len(prompt) + 2), draft[2], output=LOGITS)]))
    assert_logits_close(d.output.logits[0], hf.last_logits(prompt + draft[:3]), device.dtype)
    ex.release_cache([res.cache.cache_id])
