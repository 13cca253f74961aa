"""`--model FILE.gguf` with block-quantized matrices served on their blocks (the default; models/gguf/loader.py,
models/quant/blocks.py): the model holds the blocks (views of the mapped file where nothing moved them) and no
float copy, and its logits equal the same file's loaded with --gguf-dequantize within a stated tolerance."""
from __future__ import annotations

import pytest
import torch

from models.loader import load_model
from models.quant.blocks import BlockWeight, QuantEmbedding, block_weights, weight_format
from tests.executor.test_executor_parity import prompt_of
from tests.executor_driver import greedy_run, make_executor, teacher_forced_logits
from tests.gguf_files import make_family_checkpoint, write_gguf
from tests.models.test_gguf_checkpoint import WIDE

# Logits of the blocks against the dequantized weights (relative L2 error, logits_error). The numpy fallback
# and prefill (dequantized blocks, float GEMM) multiply the same float weights: ~1e-6. Decode calls run the
# native kernel, which quantizes activations to 8 bits per block of 32 as llama.cpp does: ~0.5% per product
# (tests/models/test_block_weights.py), which these tiny random models amplify to 5-14% of the logits
# (measured; the same as 8-bit activations emulated in Python). A wrong row, part or format is ~100%.
LOGITS_TOLERANCE = 0.25
TOP1_AGREEMENT = 0.8  # of the teacher-forced steps, at least (8-bit activations flip near-ties)


def logits_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative error of a step's logits: |got - want| / |want| (L2 over the vocabulary)."""
    return max(float((g - w).norm() / w.norm()) for g, w in zip(got, want))


@pytest.fixture(scope="module")
def hf_dirs(tiny_checkpoint, tmp_path_factory):
    built = {}

    def make(family: str):
        if family not in built:
            built[family] = tiny_checkpoint(family, config_overrides=WIDE) if family in ("llama", "qwen2") \
                else make_family_checkpoint(family, tmp_path_factory.mktemp(f"hf-{family}"))
        return built[family]

    return make


@pytest.mark.parametrize("family, qtype", [("llama", "Q4_K"), ("qwen2", "Q8_0"), ("gemma2", "Q6_K")])
def test_blocks_equal_the_dequantized_file_within_tolerance(hf_dirs, tmp_path, family, qtype):
    path, _ = write_gguf(hf_dirs(family), tmp_path / f"{family}-{qtype}.gguf", qtype)
    blocks, floats = make_executor(path), make_executor(path, gguf_dequantize=True)
    assert blocks.info().quantization == f"gguf-blocks:{qtype}" and floats.info().quantization == "none"
    assert blocks.transfer.fingerprint != floats.transfer.fingerprint  # KV never moves between them
    prompt = prompt_of(40, seed=3)  # (past Gemma 2's 16-token window)
    _, tokens, want = greedy_run(floats, prompt, 16)
    got = teacher_forced_logits(blocks, prompt, tokens)
    err = logits_error(got, want)
    agree = sum(int(g.argmax() == w.argmax()) for g, w in zip(got, want)) / len(want)
    print(f"{family} {qtype}: logits error {err:.2e}, top-1 agreement {agree:.0%}")
    assert err < LOGITS_TOLERANCE and agree >= TOP1_AGREEMENT


def test_one_resident_copy_no_float_weights(hf_dirs, tmp_path):
    """Every matrix is in blocks, the tied LM head multiplies with the embedding's blocks, the float parameters
    are the norms only, and blocks nothing moved are views of the file's mapping."""
    path, _ = write_gguf(hf_dirs("llama"), tmp_path / "m.gguf", "Q8_0")
    model = load_model(path, progress=False)
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and model.lm_head.quant is emb.blocks
    assert weight_format(model) == "gguf-blocks:Q8_0"
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(linear.quant, BlockWeight) and linear.weight.untyped_storage().nbytes() == 4
    floats = sum(p.numel() for p in model.parameters() if p.untyped_storage().nbytes() > 4)
    cfg = model.config
    assert floats == cfg.hidden_size * (2 * cfg.num_layers + 1)  # the RMSNorm weights
    blocks = sum(w.nbytes for w in block_weights(model))
    assert blocks == sum(p.numel() for p in load_model(path, progress=False, gguf_dequantize=True).parameters()
                         if p.dim() == 2) * 34 // 32  # Q8_0: 34 bytes per 32 weights, each matrix once
    with open("/proc/self/maps") as f:
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f if str(path) in line]
    down = layer.mlp.down_proj.quant.parts[0][1]  # (q/k rows are un-permuted: a copy; down_proj is not moved)
    assert any(s <= down.data_ptr() < e for s, e in spans)


def test_int8_applies_to_the_float_matrices_only(hf_dirs, tmp_path):
    """--quantization int8 quantizes the matrices a file stores as float; a Q8_0 file has none (every matrix
    stays in its blocks, and GetInfo names both)."""
    path, _ = write_gguf(hf_dirs("llama"), tmp_path / "m.gguf", "Q8_0")
    ex = make_executor(path, quantization="int8")
    assert ex.info().quantization == "gguf-blocks:Q8_0,int8" and ex.quantization_kernel is None
