"""Blocks shared between caches by prefix caching, in process: truncating into shared blocks never changes
them for the other caches (copy-on-write), a CreateCache item that is wrong fails alone, a call refused for
a full pool changes nothing (the matched blocks stay pinned), and sessions that end give their created
caches' blocks back. The outputs on each device (tests/devices.py) against prefix caching off there: float32 on
the CPU to 1e-4, bfloat16 on CUDA within its tolerance (tests/device_tolerances.py); the validation and the
sessions' bookkeeping run on the CPU only (no device arithmetic)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.executor import Executor
from executor_service.request_validation import MAX_CREATE_ITEMS
from executor_service.types import CacheRef, CreateCacheItem, DecodeItem, UnifiedItem
from tandem.errors import AdapterNotFound, InvalidRequest, KvCapacityExceeded, SequenceTooLong
from tandem.status_map import status_for
from tests.device_tolerances import assert_logits_close, greedy_agreement
from tests.executor_driver import LOGITS, create_cache, make_executor, raising, warm_prefixes

TOL = 1e-4  # float32's (tests/device_tolerances.py), which tests/executor/test_whole_prompt_reuse.py asserts


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


def assert_all_back(ex) -> None:
    u = ex.kv_usage()
    assert (u.free_blocks, u.active_caches) == (u.total_blocks, 0)
    assert u.cached_blocks == ex.prefix_stats().indexed_blocks <= u.free_blocks


@pytest.fixture(scope="module")
def off(model_dir, device):
    """The reference: prefix caching off, same weights, same device."""
    return make_executor(model_dir, prefix_caching=False, device=device)


def truncation_scenario(ex: Executor, share: bool) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Cache A holds a 40-token prompt; cache B the same prompt + 10 tokens (through create_caches, sharing
    A's 2 full blocks, when share). B is truncated into shared block 1 and decodes other tokens; A decodes;
    B verifies a draft and is truncated into shared block 0, decodes; A decodes again. Returns every
    output as (tokens, logits)."""
    p, extra = prompt_of(40, seed=7), prompt_of(10, seed=8)
    out: dict[str, tuple[list[int], torch.Tensor]] = {}

    def decode(name: str, cache_id: str, pos: int, token: int, steps: int) -> int:
        (d,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, pos), token, output=LOGITS)], num_steps=steps))
        out[name] = ([t.token_id for t in d.output.tokens], d.output.logits)
        return d.output.tokens[-1].token_id

    a = ex.prefill(p, output=LOGITS)
    a_id = a.cache.cache_id
    b_id, cached = create_cache(ex, p + extra) if share else (None, 0)
    assert cached == (32 if share else 0)
    b = ex.prefill((p + extra)[cached:], b_id, output=LOGITS)
    b_id = b.cache.cache_id
    out["b prompt"] = ([b.output.tokens[0].token_id], b.output.logits)
    assert ex.truncate_cache(b_id, 20).seq_len == 20  # inside block 1, which A holds too
    decode("b after truncate", b_id, 20, 77, 4)
    last_a = decode("a", a_id, 40, a.output.tokens[0].token_id, 4)
    v = ex.forward_verify(CacheRef(b_id, 24), prompt_of(5, seed=9), output=LOGITS)
    out["b verify"] = ([p.tokens[0].token_id for p in v.positions], torch.cat([p.logits for p in v.positions]))
    assert ex.truncate_cache(b_id, 8).seq_len == 8  # inside block 0
    decode("b after truncate to 8", b_id, 8, 55, 3)
    decode("a again", a_id, 44, last_a, 3)
    ex.release_cache([a_id, b_id])
    return out


def test_truncate_inside_shared_blocks(model_dir, off, device):
    on = make_executor(model_dir, device=device)
    got = truncation_scenario(on, share=True)
    stats = on.prefix_stats()
    assert stats.copied_blocks == 2  # block 1 for B's first write after the truncation, block 0 for the second
    ref = truncation_scenario(off, share=False)  # nothing shared
    assert off.prefix_stats().copied_blocks == 0
    for name, (tokens, logits) in ref.items():
        greedy_agreement(got[name][0], list(got[name][1]), tokens, list(logits), device.dtype, name)
    assert_all_back(on)


def test_create_cache_items_fail_alone(model_dir):
    ex = make_executor(model_dir, kv_blocks=32)
    p = prompt_of(40, seed=1)
    warm_prefixes(ex, [p])
    before = ex.kv_usage()
    results = ex.create_caches([
        CreateCacheItem(tuple(p)),
        CreateCacheItem((5, 448)),  # the tiny vocabulary is 448 ids
        CreateCacheItem(tuple(p), adapter="nope"),
        CreateCacheItem(tuple(p), cache_salt="s" * 257),
        CreateCacheItem(tuple(prompt_of(257, seed=2))),  # the model's maximum length is 256
        CreateCacheItem(tuple(p), cache_salt="s" * 256),
        CreateCacheItem(()),  # an empty cache
    ])
    kinds = [type(r.error) if r.error else None for r in results]
    assert kinds == [None, InvalidRequest, AdapterNotFound, InvalidRequest, SequenceTooLong, None, None]
    assert [status_for(r.error).name for r in results if r.error] == [
        "INVALID_ARGUMENT", "NOT_FOUND", "INVALID_ARGUMENT", "OUT_OF_RANGE"]
    for n, r in enumerate(results):
        if r.error:
            assert str(r.error).startswith(f"item {n}: ") and (r.cache.cache_id, r.cache.seq_len, r.cached_tokens) == ("", 0, 0)
    assert "outside the vocabulary" in str(results[1].error) and "256" in str(results[3].error)
    assert [r.cached_tokens for r in results if not r.error] == [32, 0, 0]  # the salted one is another tenant
    created = [r.cache.cache_id for r in results if not r.error]
    assert ex.kv_usage().active_caches == 3 and len(set(created)) == 3
    assert ex.kv_usage().free_blocks == before.free_blocks - 2  # only the matched blocks are held
    assert ex.kv_usage().cached_blocks == before.cached_blocks - 2
    # The call's own errors: nothing created.
    for items in ([], [CreateCacheItem(tuple(p))] * (MAX_CREATE_ITEMS + 1)):
        with pytest.raises(InvalidRequest, match="1 to 256 items"):
            ex.create_caches(items)
    assert ex.kv_usage().active_caches == 3
    # The empty cache takes a prompt like any other.
    res = ex.prefill(p, created[2], output=LOGITS)
    assert res.cache.seq_len == 40 and res.cached_tokens == 0
    ex.release_cache(created)
    assert ex.prefix_stats().query_tokens == 80  # the valid non-empty prompts
    assert_all_back(ex)


def test_full_pool_after_create_cache_changes_nothing(model_dir, off, device):
    ex = make_executor(model_dir, kv_blocks=6, device=device)
    p = prompt_of(40, seed=3)
    warm_prefixes(ex, [p])
    cache_id, cached = create_cache(ex, p)
    assert cached == 32
    u = ex.kv_usage()
    assert (u.free_blocks, u.cached_blocks) == (4, 0)  # the two matched blocks are the cache's
    blocks = list(ex._caches[cache_id].table.blocks)
    for items in ([UnifiedItem(tuple(p[32:]), cache_id, 32), UnifiedItem(tuple(prompt_of(70, seed=4)))],
                  [UnifiedItem(tuple(prompt_of(70, seed=4)))]):
        with pytest.raises(KvCapacityExceeded):
            ex.unified_decode(items)
        assert ex.kv_usage() == u and ex.cache_length(cache_id) == 32
        assert ex._caches[cache_id].table.blocks == blocks and ex.prefix_stats().evicted_blocks == 0
    res = ex.prefill(p[32:], cache_id, output=LOGITS)  # the cache carries on from its pinned prefix
    ref = off.prefill(p, output=LOGITS)
    greedy_agreement([res.output.tokens[0].token_id], [res.output.logits[0]], [ref.output.tokens[0].token_id],
                     [ref.output.logits[0]], device.dtype, "after the refused calls")
    off.release_cache([ref.cache.cache_id])
    ex.release_cache([cache_id])
    assert_all_back(ex)
    assert ex.kv_usage().cached_blocks == 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ended_sessions_give_created_caches_back(model_dir):
    clock = FakeClock()
    ex = Executor(ExecutorConfig(Path(model_dir), device="cpu", kv_blocks=16, progress=False, session_ttl_s=10.0),
                  clock=clock)
    p = prompt_of(40, seed=5)
    warm_prefixes(ex, [p])
    cached_before = ex.kv_usage().cached_blocks
    for end in ("close", "lapse"):
        session = ex.open_session("prefix-test").session_id
        (r,) = ex.create_caches([CreateCacheItem(tuple(p))], session=session)
        assert r.cached_tokens == 32 and r.error is None
        ex.prefill(p[32:], r.cache.cache_id, session=session)
        assert ex.kv_usage().cached_blocks == cached_before - 2
        if end == "close":
            assert ex.close_session(session) == 1
        else:
            clock.now += 11.0
            assert ex.reap_lapsed() == 1
        assert_all_back(ex)
        assert ex.kv_usage().cached_blocks == cached_before  # back to cached-evictable, still matched


def test_random_mix_over_shared_prefixes_keeps_every_cache_right(model_dir, off, device):
    """Random creates (prompts sharing prefixes), decodes, drafts, truncations and releases over a small
    pool: the accounting stays exact, and every few operations each live cache's next-token logits equal
    those of the same tokens prefilled fresh with prefix caching off (no shared block was ever changed)."""
    ex = make_executor(model_dir, kv_blocks=20, device=device)
    total = ex.kv_usage().total_blocks
    rng = random.Random(1)
    bases = [prompt_of(48, seed=s) for s in range(3)]
    live: dict[str, list[int]] = {}  # cache id -> the tokens it holds
    refused = checked = 0

    def check(cache_id: str) -> None:
        tokens = live[cache_id]
        probe = rng.randrange(3, 400)
        (d,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, len(tokens)), probe, output=LOGITS)]))
        ref = off.prefill(tokens + [probe], output=LOGITS)
        off.release_cache([ref.cache.cache_id])
        assert_logits_close(d.output.logits[0], ref.output.logits[0], device.dtype, f"{len(tokens)} tokens")
        ex.truncate_cache(cache_id, len(tokens))

    for step in range(120):
        op = rng.choice(["create", "create", "decode", "truncate", "verify", "release", "release"])
        try:
            if op == "create" or not live:
                prompt = rng.choice(bases)[:rng.randrange(1, 49)] + prompt_of(rng.randrange(0, 8), seed=1000 + step)
                cache_id, cached = create_cache(ex, prompt)
                assert cached % 16 == 0 and cached < len(prompt)
                live[cache_id] = prompt[:cached]  # what it holds if the pool refuses the rest
                ex.prefill(prompt[cached:], cache_id)
                live[cache_id] = prompt
            else:
                cache_id = rng.choice(list(live))  # insertion order: the run is reproducible
                tokens = live[cache_id]
                if op == "decode" and len(tokens) < 200:
                    first = rng.randrange(3, 400)
                    (d,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, len(tokens)), first)],
                                             num_steps=rng.randrange(1, 4)))
                    tokens += [first] + [t.token_id for t in d.output.tokens[:-1]]
                elif op == "verify" and len(tokens) < 200:
                    draft = prompt_of(rng.randrange(1, 6), seed=2000 + step)
                    ex.forward_verify(CacheRef(cache_id, len(tokens)), draft)
                    tokens += draft
                elif op == "truncate":
                    del tokens[rng.randrange(0, len(tokens) + 1):]
                    ex.truncate_cache(cache_id, len(tokens))
                elif op == "release":
                    ex.release_cache([cache_id])
                    del live[cache_id]
        except KvCapacityExceeded:
            refused += 1
        u = ex.kv_usage()
        held = len({b for c in live for b in ex._caches[c].table.blocks})
        assert held + u.free_blocks == total and u.cached_blocks <= u.free_blocks and u.active_caches == len(live)
        for c, tokens in live.items():
            assert ex.cache_length(c) == len(tokens)
        if step % 10 == 9:
            for c in list(live):
                if live[c]:
                    try:
                        check(c)
                        checked += 1
                    except KvCapacityExceeded:
                        refused += 1
    stats = ex.prefix_stats()
    assert checked > 20 and stats.hit_tokens > 0 and stats.copied_blocks > 0 and stats.evicted_blocks > 0
    ex.release_cache(list(live))
    assert_all_back(ex)


class Boom(RuntimeError):
    """An injected fault."""


@pytest.mark.parametrize("shared", [True, False], ids=["held-by-another-cache", "cached-only"])
def test_a_failed_call_takes_back_its_copy_on_write(model_dir, off, monkeypatch, shared, device):
    """A cache truncated into an indexed block, then a call that fails after reserving (the forward raises):
    the cache keeps its original block (no private copy left behind), the pool is as before, and the next
    call answers right."""
    # The fault is injected into the PyTorch forward, so decode calls must run it too (not the native step,
    # whose failures tests/executor/test_native_decode.py injects, nor CUDA graphs, which replay without it).
    ex = make_executor(model_dir, kv_blocks=8, decode_kernel="torch", device=device, cuda_graphs=False)
    p = prompt_of(40, seed=12)
    a = ex.prefill(p)
    if shared:
        other, cached = create_cache(ex, p)  # holds a's 2 indexed blocks too
        assert cached == 32
    ex.truncate_cache(a.cache.cache_id, 20)  # into indexed block 1
    state = ex._caches[a.cache.cache_id]
    before = (list(state.table.blocks), list(state.table.hashes), ex.kv_usage(), ex.prefix_stats())
    real = ex.model.forward
    monkeypatch.setattr(ex.model, "forward", lambda *args, **kwargs: (_ for _ in ()).throw(Boom("injected")))
    with pytest.raises(Boom):
        ex.decode([DecodeItem(CacheRef(a.cache.cache_id, 20), 5)], num_steps=3)
    with pytest.raises(Boom):
        ex.unified_decode([UnifiedItem((5, 6), a.cache.cache_id, 20), UnifiedItem(tuple(prompt_of(30, seed=13)))])
    assert (list(state.table.blocks), list(state.table.hashes), ex.kv_usage(), ex.prefix_stats()) == before
    monkeypatch.setattr(ex.model, "forward", real)
    (d,) = raising(ex.decode([DecodeItem(CacheRef(a.cache.cache_id, 20), 5, output=LOGITS)]))
    ref = off.prefill(p[:20] + [5], output=LOGITS)
    off.release_cache([ref.cache.cache_id])
    assert_logits_close(d.output.logits[0], ref.output.logits[0], device.dtype, "after the failed calls")
    assert ex.prefix_stats().copied_blocks == 1
    ex.release_cache([a.cache.cache_id] + ([other] if shared else []))
    assert_all_back(ex)
