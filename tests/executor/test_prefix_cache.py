"""Automatic prefix caching in process: prompts reuse cached prefixes through create_caches, and
every output equals that of an executor with prefix caching off on the same weights (tokens identical,
logits within the parity suites' tolerance): a shared system prompt over many requests (tiny model and
SmolLM2), multi-turn chat, mixed batches with chunked prefill, multi-step decode, Qwen3-MoE, a small pool
that evicts; adapters, reloaded adapter weights and cache salts never share KV. On each device (tests/devices.py):
the CPU's float32 runs agree to the token, CUDA's bfloat16 ones within bfloat16's tolerance
(tests/device_tolerances.py: a cached prefix is attended in another order than a fresh prompt); Qwen3-MoE and
SmolLM2 (its weights do not travel to a GPU) stay on the CPU."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from tokenizers import Tokenizer

from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from tests.device_tolerances import assert_logits_close, greedy_agreement
from tests.executor_driver import (LOGITS, create_cache, make_executor, mixed_batch_run, prefill_prompt, raising,
                                   warm_prefixes)
from tests.lora_fixtures import make_peft_adapter

BS = 16


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


@dataclass
class Run:
    cached: int  # tokens reused from the prefix cache
    tokens: list[int]
    logits: list[torch.Tensor]


def greedy(ex, prompt: list[int], steps: int, create: bool = True, adapter: str = "", salt: str = "",
           chunk: int | None = None) -> Run:
    """Greedy run (prefill through create_caches when create, then single decode steps); the cache is
    released at the end."""
    cache_id, cached, out = prefill_prompt(ex, prompt, chunk, adapter, create, salt)
    tokens, logits = [out.tokens[0].token_id], [out.logits[0]]
    for _ in range(steps - 1):
        (d,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, len(prompt) + len(tokens) - 1), tokens[-1],
                                             output=LOGITS, adapter=adapter)]))
        tokens.append(d.output.tokens[0].token_id)
        logits.append(d.output.logits[0])
    ex.release_cache([cache_id])
    return Run(cached, tokens, logits)


def assert_same(got_tokens, got_logits, ref_tokens, ref_logits, dtype: torch.dtype = torch.float32,
                what: str = "") -> None:
    """float32: every token equal and the logits within 1e-4; bfloat16: so up to a near tie of the reference's,
    where the two runs part (tests/device_tolerances.greedy_agreement)."""
    assert len(got_logits) == len(ref_logits), what
    greedy_agreement(got_tokens, got_logits, ref_tokens, ref_logits, dtype, what)


def assert_all_back(ex) -> None:
    """No cache left: every block free, the cached ones (still indexed) among them."""
    u, stats = ex.kv_usage(), ex.prefix_stats()
    assert (u.free_blocks, u.active_caches) == (u.total_blocks, 0)
    assert u.cached_blocks == stats.indexed_blocks <= u.free_blocks


@pytest.fixture(scope="module")
def off(model_dir, device):
    """The reference: prefix caching off, same weights, same device."""
    ex = make_executor(model_dir, prefix_caching=False, device=device)
    assert "prefix_caching" not in ex.info().capabilities
    return ex


def test_shared_system_prompt_over_many_requests(model_dir, off, device):
    on = make_executor(model_dir, device=device)
    assert "prefix_caching" in on.info().capabilities and on.prefix_stats().enabled
    system = prompt_of(40, seed=100)
    prompts = [system + prompt_of(3 + i, seed=200 + i) for i in range(6)]
    for i, p in enumerate(prompts):  # one after another: each reuses the 2 full blocks of the system prompt
        run = greedy(on, p, 3)
        assert run.cached == (0 if i == 0 else 32)
        ref = greedy(off, p, 3, create=False)
        assert_same(run.tokens, run.logits, ref.tokens, ref.logits, device.dtype, f"request {i}")
    stats = on.prefix_stats()
    assert (stats.query_tokens, stats.hit_tokens) == (sum(map(len, prompts)), 5 * 32)
    assert_all_back(on)
    # All at once: six caches share the system prompt's blocks, mixed in one batch per step.
    cached = on.kv_usage().cached_blocks
    seen: list[int] = []
    gen, logits = mixed_batch_run(on, prompts, 3, create=range(6), chunk=5,
                                  on_step=lambda *_: seen.append(on.kv_usage().cached_blocks))
    assert seen[0] == cached - 2  # the system prompt's 2 blocks are held (once each) by all six caches
    ref_gen, ref_logits = mixed_batch_run(off, prompts, 3, chunk=5)
    for i in range(6):
        assert_same(gen[i], logits[i], ref_gen[i], ref_logits[i], device.dtype, f"sequence {i}")
    assert on.prefix_stats().hit_tokens == 11 * 32 + 15  # + the 48-token prompt's 3rd block, less its last token
    assert off.prefix_stats().hit_tokens == 0 and off.kv_usage().cached_blocks == 0
    assert_all_back(on)


def test_multi_turn_chat_hit_grows(model_dir, off, device):
    """Turn k+1's prompt = turn k's prompt + its answer + new text: each turn reuses the blocks the previous
    turns computed (prompt and answer alike)."""
    on = make_executor(model_dir, device=device)
    steps = 6
    prompt = prompt_of(20, seed=1)
    hits = []
    for turn in range(4):
        run = greedy(on, prompt, steps)
        ref = greedy(off, prompt, steps, create=False)
        assert_same(run.tokens, run.logits, ref.tokens, ref.logits, device.dtype, f"turn {turn}")
        hits.append(run.cached)
        prompt = prompt + run.tokens + prompt_of(7, seed=10 + turn)
    assert hits == [0, 16, 32, 48]
    assert_all_back(on)


def test_mixed_batch_with_chunked_rest_and_new_caches(model_dir, off, device):
    """One unified_decode mixes a chunk of the rest of a CreateCache'd prompt, a decode of another cache and a
    new cache; then whole runs where the rest of created prompts goes in several chunks of 5 beside decodes and
    new caches' chunks."""
    on = make_executor(model_dir, device=device)
    prompts = [prompt_of(41, seed=1), prompt_of(9, seed=2), prompt_of(50, seed=3), prompt_of(20, seed=4)]
    warm_prefixes(on, [prompts[0][:20], prompts[2]])
    outs = []
    for ex in (on, off):
        other = ex.prefill(prompts[1])
        cache_id, cached = create_cache(ex, prompts[0])  # reuses nothing on `off`
        assert cached == (16 if ex is on else 0)
        created, decode, new = raising(ex.unified_decode([
            UnifiedItem(tuple(prompts[0][cached:cached + 5]), cache_id, cached, False),
            UnifiedItem((other.output.tokens[0].token_id,), other.cache.cache_id, 9, output=LOGITS),
            UnifiedItem(tuple(prompts[3]), output=LOGITS)]))
        assert created.output is None and created.cache.seq_len == cached + 5
        rest = ex.prefill(prompts[0][cached + 5:], cache_id, output=LOGITS)
        outs.append([decode.output.logits[0], new.output.logits[0], rest.output.logits[0]])
        ex.release_cache([cache_id, other.cache.cache_id, new.cache.cache_id])
    for got, ref in zip(*outs):
        assert_logits_close(got, ref, device.dtype, "prefix cache on vs off")
    gen, logits = mixed_batch_run(on, prompts, 6, chunk=5, create=(0, 2))
    assert on.prefix_stats().hit_tokens == 16 + 32 + 48  # prompt 0 was computed whole above
    ref_gen, ref_logits = mixed_batch_run(off, prompts, 6, chunk=5)
    for i in range(4):
        assert_same(gen[i], logits[i], ref_gen[i], ref_logits[i], device.dtype, f"sequence {i}")
    assert_all_back(on)


def test_multi_step_decode_on_a_created_cache(model_dir, off, device):
    on = make_executor(model_dir, device=device)
    prompt = prompt_of(37, seed=5)
    warm_prefixes(on, [prompt])
    results = []
    for ex, create in ((on, True), (off, False)):
        cache_id, cached, out = prefill_prompt(ex, prompt, create=create)
        first = out.tokens[0].token_id
        (d,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, len(prompt)), first, output=LOGITS)], num_steps=8))
        assert d.cache.seq_len == len(prompt) + 8
        results.append((cached, [first] + [t.token_id for t in d.output.tokens], [out.logits[0], *d.output.logits]))
        ex.release_cache([cache_id])
    (cached, tokens, logits), (_, ref_tokens, ref_logits) = results
    assert cached == 32
    assert_same(tokens, logits, ref_tokens, ref_logits, device.dtype)
    assert_all_back(on)


def test_qwen3_moe_with_prefix_caching(tiny_checkpoint):
    model = tiny_checkpoint("qwen3_moe", config_overrides=dict(num_experts=8, num_experts_per_tok=2,
                                                               norm_topk_prob=True))
    on, off_moe = make_executor(model), make_executor(model, prefix_caching=False)
    prompts = [prompt_of(n, seed=30 + n) for n in (21, 9, 40)]
    warm_prefixes(on, [prompts[0], prompts[2]])
    gen, logits = mixed_batch_run(on, prompts, 6, chunk=7, create=(0, 2))
    ref_gen, ref_logits = mixed_batch_run(off_moe, prompts, 6, chunk=7)
    assert on.prefix_stats().hit_tokens == 16 + 32
    for i in range(3):
        assert_same(gen[i], logits[i], ref_gen[i], ref_logits[i], what=f"sequence {i}")
    assert_all_back(on)


def test_eviction_under_a_small_pool(model_dir, off, device):
    """8 blocks for 5 prompts of 3 blocks each, twice over: cached blocks are evicted (least recently used,
    tails first) to make room, what is still cached is reused, and every output is unchanged."""
    on = make_executor(model_dir, kv_blocks=8, device=device)
    prompts = [prompt_of(40, seed=50 + i) for i in range(5)]
    hits = []
    for round_ in range(2):
        for i, p in enumerate(prompts):
            run = greedy(on, p, 4)
            ref = greedy(off, p, 4, create=False)
            assert_same(run.tokens, run.logits, ref.tokens, ref.logits, device.dtype, f"round {round_}, prompt {i}")
            hits.append(run.cached)
            u = on.kv_usage()
            assert u.free_blocks == u.total_blocks and u.cached_blocks <= u.free_blocks
    stats = on.prefix_stats()
    assert stats.evicted_blocks > 0
    assert hits[:5] == [0] * 5 and all(h % BS == 0 for h in hits)
    assert stats.hit_tokens == sum(hits)
    assert stats.stored_blocks - stats.evicted_blocks == stats.indexed_blocks <= 8
    assert_all_back(on)


def test_shared_system_prompt_smollm2(smollm2_dir):
    """The real model: a chat system prompt shared by requests; identical to prefix caching off."""
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    system = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face. Answer "
              "briefly, in plain English, and say so when you do not know the answer.<|im_end|>\n")
    questions = ["What is the capital of France?", "Name a prime number."]
    prompts = [tok.encode(f"{system}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False).ids for q in questions]
    shared = len(tok.encode(system, add_special_tokens=False).ids) // BS * BS
    assert shared >= 32
    on = make_executor(smollm2_dir, kv_blocks=32)
    off_smol = make_executor(smollm2_dir, kv_blocks=32, prefix_caching=False)
    for i, p in enumerate(prompts):
        run = greedy(on, p, 2)
        assert run.cached == (0 if i == 0 else shared)
        ref = greedy(off_smol, p, 2, create=False)
        assert_same(run.tokens, run.logits, ref.tokens, ref.logits, what=f"question {i}")
    assert_all_back(on)


# ----------------------------------------------------------------------------- isolation
@pytest.fixture(scope="module")
def adapter_root(model_dir, tmp_path_factory):
    pytest.importorskip("peft", reason="the adapters are written with peft (a lent GPU's bundle may lack it)")
    root = tmp_path_factory.mktemp("prefix-lora")
    for name, seed in (("a", 1), ("b", 2), ("a_new", 3)):  # a_new: a's shape, other weights
        make_peft_adapter(model_dir, root / name, r=4, alpha=8, target_modules=("q_proj", "k_proj", "v_proj"),
                          seed=seed)
    return root


def test_adapters_never_share_and_reloaded_weights_never_hit(model_dir, adapter_root, device):
    ex = make_executor(model_dir, adapter_root=adapter_root, device=device)
    ex.load_adapter("a", "a")
    ex.load_adapter("b", "b")
    p = prompt_of(40, seed=9)
    first = greedy(ex, p, 3, adapter="a")
    assert first.cached == 0
    assert greedy(ex, p, 3, adapter="b").cached == 0  # same prompt, another adapter
    assert greedy(ex, p, 3).cached == 0  # nor the base model
    again = greedy(ex, p, 3, adapter="a")
    assert again.cached == 32
    assert_same(again.tokens, again.logits, first.tokens, first.logits, device.dtype)
    digest = {a.name: a.weights_digest for a in ex.list_adapters()}
    assert len(digest["a"]) == 16 and digest["a"] != digest["b"]

    # Reloaded under the same name with new weights: the old blocks are never reused.
    ex.unload_adapter("a")
    ex.load_adapter("a", "a_new")
    new_digest = next(a.weights_digest for a in ex.list_adapters() if a.name == "a")
    assert new_digest != digest["a"]
    fresh = greedy(ex, p, 3, adapter="a")
    assert fresh.cached == 0
    ref = make_executor(model_dir, adapter_root=adapter_root, device=device, prefix_caching=False)
    ref.load_adapter("a", "a_new")
    expected = greedy(ref, p, 3, create=False, adapter="a")
    assert_same(fresh.tokens, fresh.logits, expected.tokens, expected.logits, device.dtype, "reloaded adapter")
    assert fresh.logits[0].sub(first.logits[0]).abs().max() > 1e-3  # the weights do change the outputs

    # Reloaded with the same weights: same digest, the blocks are reused.
    ex.unload_adapter("a")
    ex.load_adapter("a", "a_new")
    assert next(a.weights_digest for a in ex.list_adapters() if a.name == "a") == new_digest
    same = greedy(ex, p, 3, adapter="a")
    assert same.cached == 32
    assert_same(same.tokens, same.logits, fresh.tokens, fresh.logits, device.dtype)
    assert_all_back(ex)


def test_cache_salt_isolates(model_dir, device):
    ex = make_executor(model_dir, device=device)
    p = prompt_of(40, seed=11)
    first = greedy(ex, p, 3, salt="tenant-1")
    assert first.cached == 0
    assert greedy(ex, p, 3, salt="tenant-2").cached == 0
    assert greedy(ex, p, 3).cached == 0  # the unsalted pool is another tenant too
    again = greedy(ex, p, 3, salt="tenant-1")
    assert again.cached == 32
    assert_same(again.tokens, again.logits, first.tokens, first.logits, device.dtype)
    assert greedy(ex, p, 3, salt="tenant-2").cached == 32
    assert greedy(ex, p, 3).cached == 32
    assert ex.prefix_stats().indexed_blocks == 3 * 2  # each tenant's own copy of the 2 full blocks
    assert_all_back(ex)
