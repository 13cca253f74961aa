"""Prompt logprobs in process (UnifiedItem/CreateCacheItem.prompt_logprobs): every prompt token's logprob, rank
and top alternatives equal transformers' log_softmax(logits) on the same weights within 1e-4 (Llama and
Qwen2), whole or in chunks that do not fall on block boundaries; a cached prefix returns the same values
without being computed again (the prefix cache's hit tokens, and a forward over the rest only); a block stored
with fewer alternatives than asked is computed again and upgraded; the rules an item must follow. On each device
(tests/devices.py): the CPU's float32 as said, CUDA's bfloat16 within its tolerance of the float32 reference
(tests/device_tolerances.py: a logprob within twice the logits' bound, ranks and alternatives up to near ties)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from executor_service.types import CreateCacheItem, UnifiedItem
from tandem.errors import CacheStateConflict, InvalidRequest
from tests.device_tolerances import tolerance
from tests.devices import Device
from tests.executor_driver import make_executor, raising
from tests.hf_reference import HfReference

TOL = 1e-4
BS = 16


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tiny_checkpoint, device):
    model = tiny_checkpoint(request.param)
    return make_executor(model, device=device), HfReference(model)


@dataclass(frozen=True)
class Reference:
    logprobs: torch.Tensor  # [len - 1, vocab]: row i = the distribution of prompt[i + 1]
    scale: torch.Tensor  # [len - 1]: each row's largest |logit| (what the bfloat16 bound is relative to)


def hf_prompt_logprobs(hf: HfReference, prompt: list[int]) -> Reference:
    logits = hf.all_logits(prompt)[:-1]
    return Reference(torch.log_softmax(logits, dim=-1), logits.abs().amax(-1))


def run_chunks(ex, prompt: list[int], chunks: list[int], top: int, cache_id: str | None = None, start: int = 0):
    """Writes prompt[start:] in chunks of these sizes (the last one final), asking for prompt logprobs on each;
    returns (cache id, every entry in order)."""
    got, pos = [], start
    for n, size in enumerate(chunks):
        final = n == len(chunks) - 1
        toks = tuple(prompt[pos:pos + size] if not final else prompt[pos:])
        (r,) = raising(ex.unified_decode([UnifiedItem(toks, cache_id, pos, final, prompt_logprobs=top)]))
        assert len(r.prompt_logprobs) == len(toks) - (pos == 0)
        cache_id, pos = r.cache.cache_id, pos + len(toks)
        got.extend(r.prompt_logprobs)
    return cache_id, got


def assert_matches(got, ref: Reference, prompt: list[int], top: int, first: int = 1,
                   device: Device | None = None) -> None:
    """got: entries of prompt positions first .. len - 1. float32: within TOL, ranks and alternatives exact.
    bfloat16: log_softmax moves by at most twice the largest logit error, which the dtype bounds at
    tolerance.logits of the row's largest |logit|; a rank or an alternative may then differ only among the
    reference's values within that band of each other."""
    assert [t.token_id for t in got] == prompt[first:first + len(got)]
    exact = device is None or device.exact
    for k, t in enumerate(got):
        row = ref.logprobs[first - 1 + k]
        err = TOL if exact else 2 * tolerance(device.dtype).logits * float(ref.scale[first - 1 + k])
        lp = row[prompt[first + k]]
        assert abs(t.logprob - float(lp)) < err
        if exact:
            assert t.rank == int((row > lp).sum()) + 1
        else:
            assert int((row > lp + 2 * err).sum()) + 1 <= t.rank <= int((row > lp - 2 * err).sum()) + 1
        want = row.topk(top)
        if exact:
            assert [i for i, _ in t.top_logprobs] == want.indices.tolist()
        else:
            assert len(t.top_logprobs) == top and all(float(row[i]) > float(want.values[-1]) - 2 * err
                                                      for i, _ in t.top_logprobs)
        assert max(abs(v - float(w)) for (_, v), w in zip(t.top_logprobs, want.values)) < err


def test_whole_and_chunked_prompt_match_transformers(family, device):
    ex, hf = family
    prompt = prompt_of(45, seed=1)
    ref = hf_prompt_logprobs(hf, prompt)
    cid, whole = run_chunks(ex, prompt, [45], top=5)
    assert_matches(whole, ref, prompt, 5, device=device)
    ex.release_cache([cid])
    cid, chunked = run_chunks(ex, prompt, [7, 20, 18], top=3)  # chunk edges off the block edges
    assert_matches(chunked, ref, prompt, 3, device=device)
    ex.release_cache([cid])


def test_cached_prefix_returns_stored_values_without_recompute(tiny_checkpoint, device):
    model = tiny_checkpoint("llama")
    ex, hf = make_executor(model, device=device), HfReference(model)
    prompt = prompt_of(4 * BS + 5, seed=2)
    ref = hf_prompt_logprobs(hf, prompt)
    cid, _ = run_chunks(ex, prompt, [len(prompt)], top=4)
    ex.release_cache([cid])
    before = ex.prefix_stats().hit_tokens
    (res,) = raising(ex.create_caches([CreateCacheItem(tuple(prompt), prompt_logprobs=2)]))
    assert res.cached_tokens == 4 * BS and ex.prefix_stats().hit_tokens - before == 4 * BS
    assert len(res.prompt_logprobs) == 4 * BS - 1
    assert_matches(res.prompt_logprobs, ref, prompt, 2, device=device)  # stored with 4 alternatives, cut to the 2 asked
    processed = ex.metrics.tokens_processed
    _, rest = run_chunks(ex, prompt, [5], top=2, cache_id=res.cache.cache_id, start=4 * BS)
    assert ex.metrics.tokens_processed - processed == 5  # only the uncached tail ran through the model
    assert_matches(rest, ref, prompt, 2, first=4 * BS, device=device)  # its first token: the stored hidden state
    ex.release_cache([res.cache.cache_id])


def test_blocks_without_enough_alternatives_are_computed_again(tiny_checkpoint, device):
    model = tiny_checkpoint("llama")
    ex, hf = make_executor(model, device=device), HfReference(model)
    prompt = prompt_of(3 * BS + 3, seed=3)
    ref = hf_prompt_logprobs(hf, prompt)
    (plain,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt))]))  # cached without prompt logprobs
    ex.release_cache([plain.cache.cache_id])
    (res,) = raising(ex.create_caches([CreateCacheItem(tuple(prompt), prompt_logprobs=1)]))
    assert res.cached_tokens == 0 and not res.prompt_logprobs  # nothing stored: everything is computed again
    ex.release_cache([res.cache.cache_id])
    (any_block,) = raising(ex.create_caches([CreateCacheItem(tuple(prompt))]))  # without asking: reused
    assert any_block.cached_tokens == 3 * BS
    ex.release_cache([any_block.cache.cache_id])
    cid, _ = run_chunks(ex, prompt, [len(prompt)], top=1)  # now stored with 1 alternative
    ex.release_cache([cid])
    (res,) = raising(ex.create_caches([CreateCacheItem(tuple(prompt), prompt_logprobs=1)]))
    assert res.cached_tokens == 3 * BS
    assert_matches(res.prompt_logprobs, ref, prompt, 1, device=device)
    ex.release_cache([res.cache.cache_id])
    (res,) = raising(ex.create_caches([CreateCacheItem(tuple(prompt), prompt_logprobs=6)]))  # more than stored
    assert res.cached_tokens == 0
    cid, got = run_chunks(ex, prompt, [len(prompt)], top=6, cache_id=res.cache.cache_id)
    assert_matches(got, ref, prompt, 6, device=device)
    ex.release_cache([cid])
    (res,) = raising(ex.create_caches([CreateCacheItem(tuple(prompt), prompt_logprobs=6)]))  # upgraded
    assert res.cached_tokens == 3 * BS
    ex.release_cache([res.cache.cache_id])


def test_item_rules(tiny_checkpoint):
    ex = make_executor(tiny_checkpoint("llama"))
    prompt = prompt_of(20, seed=4)
    (r,) = ex.unified_decode([UnifiedItem(tuple(prompt[:10]), None, 0, False)])  # no prompt logprobs asked
    (bad,) = ex.unified_decode([UnifiedItem(tuple(prompt[10:]), r.cache.cache_id, 10, True, prompt_logprobs=0)])
    assert isinstance(bad.error, CacheStateConflict)
    (bad,) = ex.unified_decode([UnifiedItem(tuple(prompt), prompt_logprobs=21)])
    assert isinstance(bad.error, InvalidRequest)
    (bad,) = ex.unified_decode([UnifiedItem(tuple(prompt), prompt_logprobs=0, draft_token_ids=(5,))])
    assert isinstance(bad.error, InvalidRequest)
    (ok,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt), prompt_logprobs=0)]))
    assert [t.top_logprobs for t in ok.prompt_logprobs] == [[]] * 19 and ok.output.tokens
