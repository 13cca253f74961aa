"""Parity of the in-process Executor with transformers on tiny random Qwen3-MoE checkpoints (fp32).

Four router shapes: 8 experts top-2 (renormalised), 4 experts top-1, 8 experts top-4 (not renormalised),
and 4 layers with dense MLP layers mixed in (mlp_only_layers + decoder_sparse_step; transformers gives
those layers the dense MLP of `intermediate_size`). Each: 32-token greedy runs (whole and chunked prefill),
a mixed batch of 5 sequences, forward_verify + truncate_cache, the reported MoE shape, and the
per-expert routing counts.
"""
from __future__ import annotations

import json
import random

import pytest

from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from tests.executor_driver import LOGITS, assert_greedy_matches, greedy_run, make_executor, mixed_batch_run
from tests.hf_reference import HfReference, rel_err

TOL = 1e-4
STEPS = 32

CASES = {
    "e8-top2-norm": dict(config_overrides=dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "e4-top1": dict(config_overrides=dict(num_experts=4, num_experts_per_tok=1)),
    "e8-top4-nonorm": dict(config_overrides=dict(num_experts=8, num_experts_per_tok=4, norm_topk_prob=False)),
    "dense-mixed": dict(num_layers=4, config_overrides=dict(mlp_only_layers=[1], decoder_sparse_step=2)),
}


def prompt_of(length: int, seed: int = 0, low: int = 3, high: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(length)]


class Setup:
    def __init__(self, name: str, model_dir) -> None:
        self.name, self.model_dir = name, model_dir
        self.hf = HfReference(model_dir)
        self.config = json.loads((model_dir / "config.json").read_text())
        self._greedy: dict[tuple, tuple] = {}

    def greedy(self, prompt: list[int], steps: int = STEPS):
        key = (tuple(prompt), steps)
        if key not in self._greedy:
            self._greedy[key] = self.hf.greedy(prompt, steps)
        return self._greedy[key]

    @property
    def top_k(self) -> int:
        return self.config["num_experts_per_tok"]

    @property
    def num_experts(self) -> int:
        return self.config.get("num_experts", self.config.get("num_local_experts"))

    @property
    def moe_layers(self) -> list[int]:
        """transformers' Qwen3MoeDecoderLayer rule, from the checkpoint's own config.json."""
        c = self.config
        return [i for i in range(c["num_hidden_layers"])
                if i not in c.get("mlp_only_layers", []) and self.num_experts > 0
                and (i + 1) % c.get("decoder_sparse_step", 1) == 0]


@pytest.fixture(scope="module", params=list(CASES))
def moe(request, tiny_checkpoint):
    return Setup(request.param, tiny_checkpoint("qwen3_moe", **CASES[request.param]))


def test_checkpoint_shape(moe):
    """Guards the cases themselves: the dense-mixed case really mixes dense and sparse layers."""
    hf_mlps = [type(layer.mlp).__name__ for layer in moe.hf.model.model.layers]
    assert [i for i, n in enumerate(hf_mlps) if n == "Qwen3MoeSparseMoeBlock"] == moe.moe_layers
    if moe.name == "dense-mixed":
        assert moe.moe_layers == [3]


@pytest.mark.parametrize("chunk,prefix", [(None, False), (7, False), (7, True)],
                         ids=["whole-prefix-off", "chunks-of-7-prefix-off", "chunks-of-7-prefix-on"])
def test_greedy_32_matches_transformers(moe, chunk, prefix):
    """prefix-on: the prompt's cached first block is reused (create_caches), the rest goes in chunks of 7."""
    ex = make_executor(moe.model_dir, prefix_caching=prefix)
    prompt = prompt_of(21, seed=1)
    ref_tokens, ref_logits = moe.greedy(prompt)
    assert_greedy_matches(ex, prompt, ref_tokens, ref_logits, STEPS, chunk=chunk, create=prefix)


def test_mixed_batch_of_five_with_releases(moe):
    """5 sequences of different lengths share every forward (and so every expert dispatch): prefill chunks
    of 8 beside decodes; two are released mid-way. Each must still match its own transformers reference."""
    ex = make_executor(moe.model_dir)
    prompts = [prompt_of(n, seed=10 + n) for n in (3, 9, 17, 30, 41)]
    release_after = {1: 10, 3: 5}  # sequence -> tokens generated before it is released
    refs = [moe.greedy(p) for p in prompts]
    gen, logits = mixed_batch_run(ex, prompts, STEPS, release_after)
    for i in range(5):
        limit = release_after.get(i, STEPS)
        ref_tokens, ref_logits = refs[i]
        assert gen[i] == ref_tokens[:limit], f"sequence {i}"
        errors = [rel_err(o, r) for o, r in zip(logits[i], ref_logits)]
        assert max(errors) < TOL, f"sequence {i}, worst step {errors.index(max(errors))}: {max(errors):.2e}"
    usage = ex.kv_usage()
    assert usage.free_blocks == usage.total_blocks and usage.active_caches == 0


def test_forward_verify_and_truncate(moe):
    """forward_verify scores every draft position like transformers' full-sequence forward; truncating to
    the accepted prefix and decoding on matches transformers again (and a fresh prefill)."""
    ex = make_executor(moe.model_dir)
    prompt = prompt_of(14, seed=4)
    res = ex.prefill(prompt)
    draft = prompt_of(5, seed=5)
    v = ex.forward_verify(CacheRef(res.cache.cache_id, len(prompt)), draft, output=LOGITS)
    assert v.cache.seq_len == len(prompt) + len(draft)
    ref = moe.hf.all_logits(prompt + draft)[len(prompt):]
    assert len(v.positions) == len(draft)
    for k, pos in enumerate(v.positions):
        assert rel_err(pos.logits[0], ref[k]) < TOL, f"draft position {k}"
        assert pos.tokens[0].token_id == int(ref[k].argmax())
    keep = len(prompt) + 2  # accept two draft tokens, roll back the rest
    ex.truncate_cache(res.cache.cache_id, keep)
    nxt = v.positions[1].tokens[0].token_id
    (d,) = ex.decode([DecodeItem(CacheRef(res.cache.cache_id, keep), nxt, output=LOGITS)])
    assert rel_err(d.output.logits[0], moe.hf.last_logits(prompt + draft[:2] + [nxt])) < TOL
    ex.release_cache([res.cache.cache_id])

    # Truncate inside a block and right at a block boundary (block size 16), then decode on.
    cache_id, tokens, _ = greedy_run(ex, prompt_of(20, seed=3), 12)
    full = prompt_of(20, seed=3) + tokens  # the cache holds all but the last token
    for new_len in (23, 17, 16):
        assert ex.truncate_cache(cache_id, new_len).seq_len == new_len
        (d,) = ex.decode([DecodeItem(CacheRef(cache_id, new_len), full[new_len], output=LOGITS)])
        fresh = ex.prefill(full[:new_len + 1], output=LOGITS)
        assert rel_err(d.output.logits[0], fresh.output.logits[0]) < TOL
        assert rel_err(d.output.logits[0], moe.hf.last_logits(full[:new_len + 1])) < TOL
        ex.release_cache([fresh.cache.cache_id])
        ex.truncate_cache(cache_id, new_len)
    ex.release_cache([cache_id])
    assert ex.kv_usage().free_blocks == ex.kv_usage().total_blocks


def test_info_reports_moe_shape(moe):
    info = make_executor(moe.model_dir).info()
    assert info.architecture == "Qwen3MoeForCausalLM"
    if not hasattr(info, "num_experts"):
        pytest.skip("ExecutorInfo has no num_experts / num_experts_per_tok fields yet")
    assert info.num_experts == moe.num_experts
    assert info.num_experts_per_tok == moe.top_k
    if hasattr(info, "moe_layers"):
        assert list(info.moe_layers) == moe.moe_layers


def expert_load(ex) -> dict[int, list[int]]:
    """MoE layer -> tokens routed to each expert so far, from whichever public API the executor offers."""
    if hasattr(ex, "expert_load"):
        return {int(k): [int(c) for c in v] for k, v in ex.expert_load().items()}
    snap = ex.metrics_snapshot()
    counts = getattr(snap, "expert_tokens", None)
    if counts is None:
        pytest.skip("neither Executor.expert_load() nor MetricsSnapshot.expert_tokens exists yet")
    if isinstance(counts, dict):
        return {int(k): [int(c) for c in v] for k, v in counts.items()}
    return {i: [int(c) for c in v] for i, v in zip(sorted(ex.info().moe_layers), counts)}


def test_expert_token_counts(moe):
    """Every token run through the model is routed to exactly top_k experts in every MoE layer: whole and
    chunked prefill, multi-item unified batches, decode, forward_verify."""
    ex = make_executor(moe.model_dir)
    start = expert_load(ex)  # deltas from here: any warmup forward at load is not this test's business
    assert sorted(start) == moe.moe_layers
    assert all(len(v) == moe.num_experts for v in start.values())
    tokens0 = ex.metrics_snapshot().tokens_processed

    prompt = prompt_of(21, seed=1)
    cache_a, out_a, _ = greedy_run(ex, prompt, 6)  # 21 + 5 tokens
    cache_b, _, _ = greedy_run(ex, prompt_of(13, seed=2), 4, chunk=5)  # 13 + 3
    ex.unified_decode([UnifiedItem(tuple(prompt_of(9, seed=7)), output=LOGITS),
                       UnifiedItem((out_a[-1],), cache_a, len(prompt) + 5, output=LOGITS)])  # 9 + 1
    ex.forward_verify(CacheRef(cache_b, 16), prompt_of(4, seed=8))  # 4
    expected_tokens = (21 + 5) + (13 + 3) + (9 + 1) + 4
    processed = ex.metrics_snapshot().tokens_processed - tokens0
    assert processed == expected_tokens
    load = expert_load(ex)
    for layer in moe.moe_layers:
        routed = [now - before for now, before in zip(load[layer], start[layer])]
        assert sum(routed) == expected_tokens * moe.top_k, f"layer {layer}: {routed}"
        assert all(c >= 0 for c in routed)


def test_dense_model_reports_no_experts(tiny_checkpoint):
    ex = make_executor(tiny_checkpoint("qwen3"))
    info = ex.info()
    if not hasattr(info, "num_experts"):
        pytest.skip("ExecutorInfo has no num_experts field yet")
    assert (info.num_experts, info.num_experts_per_tok, tuple(getattr(info, "moe_layers", ()))) == (0, 0, ())
    if hasattr(ex, "expert_load"):
        ex.prefill(prompt_of(5))
        assert ex.expert_load() == {}
