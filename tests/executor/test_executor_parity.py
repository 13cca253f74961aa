"""Parity of the in-process Executor with transformers on tiny random checkpoints: on the CPU in float32, and on
CUDA in bfloat16 against the same CPU float32 reference (the `device` fixture; tolerances per dtype in
tests/device_tolerances.py).

The greedy, mixed-batch and truncation tests run both ways: prefix caching off (--no-prefix-caching), and on
with the prompts' prefixes cached first and reused through create_caches (only the rest is computed)."""
from __future__ import annotations

import random

import pytest

from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from tests.executor_driver import (LOGITS, assert_greedy_matches, greedy_run, make_executor, mixed_batch_run,
                                   warm_prefixes)
from tests.device_tolerances import assert_greedy_token, assert_logits_close, greedy_agreement
from tests.hf_reference import HfReference

ARCHS = ["llama", "qwen2", "qwen3"]
STEPS = 32


def prompt_of(length: int, seed: int = 0, low: int = 3, high: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(length)]


# prefix caching off; on, with the prompts' cached prefixes reused (create_caches)
PREFIX = pytest.mark.parametrize("prefix", [False, True], ids=["prefix-off", "prefix-on"])


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request, tiny_checkpoint):
    model_dir = tiny_checkpoint(request.param)
    return request.param, model_dir, HfReference(model_dir)


@PREFIX
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunks-of-7"])
def test_greedy_32_matches_transformers(arch_setup, chunk, prefix, device):
    _, model_dir, hf = arch_setup
    ex = make_executor(model_dir, prefix_caching=prefix, device=device)
    prompt = prompt_of(21, seed=1)
    ref_tokens, ref_logits = hf.greedy(prompt, STEPS)
    assert_greedy_matches(ex, prompt, ref_tokens, ref_logits, STEPS, device.dtype, chunk, create=prefix)


@PREFIX
def test_mixed_batch_of_five_with_releases(arch_setup, prefix, device):
    """5 sequences of different lengths share every forward: prefill chunks of 8 beside decodes; two are
    released mid-way. Each must still match its own transformers reference token for token. prefix-on: the
    three longer prompts start from their cached prefixes (create_caches), beside new caches."""
    _, model_dir, hf = arch_setup
    ex = make_executor(model_dir, prefix_caching=prefix, device=device)
    prompts = [prompt_of(n, seed=10 + n) for n in (3, 9, 17, 30, 41)]
    release_after = {1: 10, 3: 5}  # sequence -> tokens generated before it is released
    refs = [hf.greedy(p, STEPS) for p in prompts]
    if prefix:
        warm_prefixes(ex, prompts)
    gen, logits = mixed_batch_run(ex, prompts, STEPS, release_after, create=(2, 3, 4) if prefix else ())
    if prefix:
        assert ex.prefix_stats().hit_tokens == 16 + 16 + 32
    for i in range(5):
        limit = release_after.get(i, STEPS)
        ref_tokens, ref_logits = refs[i]
        greedy_agreement(gen[i], logits[i], ref_tokens[:limit], ref_logits[:limit], device.dtype, f"sequence {i}")
    usage = ex.kv_usage()
    assert usage.free_blocks == usage.total_blocks and usage.active_caches == 0


@PREFIX
def test_truncate_then_decode_equals_fresh_sequence(arch_setup, prefix, device):
    """prefix-on: the first block is shared with the cached prefix, and truncating into it (9) makes the
    cache write into a private copy of it."""
    _, model_dir, hf = arch_setup
    ex = make_executor(model_dir, prefix_caching=prefix, device=device)
    prompt = prompt_of(20, seed=3)
    if prefix:
        warm_prefixes(ex, [prompt])
    cache_id, tokens, _ = greedy_run(ex, prompt, 12, create=prefix)
    full = prompt + tokens  # the cache holds all but the last token
    for new_len in (23, 17, 16, 9):  # inside a block, right at a block boundary (block size 16), in block 0
        ref = ex.truncate_cache(cache_id, new_len)
        assert ref.seq_len == new_len
        (d,) = ex.decode([DecodeItem(CacheRef(cache_id, new_len), full[new_len], output=LOGITS)])
        fresh = ex.prefill(full[:new_len + 1], output=LOGITS)
        assert_logits_close(d.output.logits[0], fresh.output.logits[0], device.dtype, f"truncated to {new_len}")
        assert_logits_close(d.output.logits[0], hf.last_logits(full[:new_len + 1]), device.dtype, "vs transformers")
        ex.release_cache([fresh.cache.cache_id])
        ex.truncate_cache(cache_id, new_len)
    ex.release_cache([cache_id])
    assert ex.kv_usage().free_blocks == ex.kv_usage().total_blocks
    assert (ex.prefix_stats().copied_blocks > 0) == prefix  # only a shared block is copied before a write


def test_forward_verify_returns_every_position(arch_setup, device):
    _, model_dir, hf = arch_setup
    ex = make_executor(model_dir, device=device)
    prompt = prompt_of(14, seed=4)
    res = ex.prefill(prompt)
    draft = prompt_of(5, seed=5)
    v = ex.forward_verify(CacheRef(res.cache.cache_id, len(prompt)), draft, output=LOGITS)
    assert v.cache.seq_len == len(prompt) + len(draft)
    ref = hf.all_logits(prompt + draft)[len(prompt):]
    assert len(v.positions) == len(draft)
    for k, pos in enumerate(v.positions):
        assert_logits_close(pos.logits[0], ref[k], device.dtype, f"draft position {k}")
        assert_greedy_token(pos.tokens[0].token_id, ref[k], device.dtype, f"draft position {k}")
    # Accept two draft tokens: roll back the rest and carry on decoding from there.
    keep = len(prompt) + 2
    ex.truncate_cache(res.cache.cache_id, keep)
    nxt = v.positions[1].tokens[0].token_id
    (d,) = ex.decode([DecodeItem(CacheRef(res.cache.cache_id, keep), nxt, output=LOGITS)])
    assert_logits_close(d.output.logits[0], hf.last_logits(prompt + draft[:2] + [nxt]), device.dtype, "after rollback")


def test_multi_step_decode_equals_single_steps(arch_setup, device):
    """The same computation either way (one decode step per call, or num_steps in one call): equal tokens on every
    device, bfloat16 included."""
    _, model_dir, _ = arch_setup
    ex = make_executor(model_dir, device=device)
    prompt = prompt_of(10, seed=6)
    _, tokens, _ = greedy_run(ex, prompt, 9)
    res = ex.prefill(prompt)
    first = res.output.tokens[0].token_id
    (d,) = ex.decode([DecodeItem(CacheRef(res.cache.cache_id, len(prompt)), first)], num_steps=8)
    assert [first] + [t.token_id for t in d.output.tokens] == tokens
    assert d.cache.seq_len == len(prompt) + 8
    # Stopping early at a stop token: the stop token is returned, nothing after it.
    res2 = ex.prefill(prompt)
    stop = tokens[3]
    (d2,) = ex.decode([DecodeItem(CacheRef(res2.cache.cache_id, len(prompt)), first,
                                  stop_token_ids=frozenset({stop}))], num_steps=8)
    got = [t.token_id for t in d2.output.tokens]
    assert got == tokens[1:tokens.index(stop, 1) + 1]


def test_equal_length_fresh_prompts_beside_a_decode(arch_setup, device):
    """Whole prompts of one length from position 0 take the plain-causal attention path; a decode in the
    same batch takes the paged path. Both must match transformers."""
    _, model_dir, hf = arch_setup
    ex = make_executor(model_dir, device=device)
    p1, p2, p3 = prompt_of(12, seed=20), prompt_of(12, seed=21), prompt_of(6, seed=22)
    first = ex.prefill(p3)
    decode_tok = first.output.tokens[0].token_id
    results = ex.unified_decode([UnifiedItem(tuple(p1), output=LOGITS),
                                 UnifiedItem((decode_tok,), first.cache.cache_id, len(p3), output=LOGITS),
                                 UnifiedItem(tuple(p2), output=LOGITS)])
    for res, tokens in zip(results, (p1, p3 + [decode_tok], p2)):
        assert_logits_close(res.output.logits[0], hf.last_logits(tokens), device.dtype, f"{len(tokens)} tokens")
