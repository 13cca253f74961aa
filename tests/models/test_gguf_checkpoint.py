"""`--model FILE.gguf --gguf-dequantize`: tiny random checkpoints written as GGUF (tests/gguf_files.py, llama.cpp's
layout) in every listed type load to exactly the weights the file holds, and the executor's logits equal
transformers run on those weights (the HF checkpoint itself for F32; its dequantized weights for the other types).
Served on their blocks instead (the default): tests/models/test_gguf_blocks.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.config import ModelConfig
from models.gguf.config import hf_config
from models.gguf.file import GgufFile
from models.gguf.tensors import permute_rope_rows, unpermute_rope_rows
from models.loader import load_model
from tandem.errors import CheckpointError
from tests.executor.test_executor_parity import prompt_of
from tests.executor_driver import greedy_run, make_executor
from tests.gguf_files import QTYPES, llama_cpp_permute, make_family_checkpoint, reference_dir, write_gguf
from tests.hf_reference import HfReference, rel_err

WIDE = {"hidden_size": 256, "intermediate_size": 512}  # rows of 256: every type, K-quants included, applies
TOLERANCE = 1e-4  # max relative logits error, as for HF directories (fp32 on CPU)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    """checkpoint(family) -> a tiny HF dir with 256-wide rows (built once per module)."""
    built = {}

    def make(family: str):
        if family not in built:
            if family in ("llama", "qwen2", "qwen3"):
                built[family] = tiny_checkpoint(family, config_overrides=WIDE)
            else:
                built[family] = make_family_checkpoint(family, tmp_path_factory.mktemp(f"hf-{family}"))
            try:
                ModelConfig.from_dir(built[family])
            except CheckpointError as exc:  # a family models/ does not serve yet
                pytest.skip(f"{family}: {exc}")
        return built[family]

    return make


def gguf_and_reference(checkpoint, tmp_path, family: str, qtype: str):
    hf_dir = checkpoint(family)
    path, state = write_gguf(hf_dir, tmp_path / f"{family}-{qtype}.gguf", qtype)
    ref = hf_dir if qtype == "F32" else reference_dir(hf_dir, state, tmp_path / "reference")
    return path, state, ref


def parity(path, ref, steps: int = 4, prompt_len: int = 24) -> float:
    """The GGUF file served dequantized equals its weights served as an HF directory bit for bit (greedy tokens
    and logits), and transformers' greedy tokens; returns the max relative logits error against transformers."""
    prompt = prompt_of(prompt_len, seed=3)
    ref_tokens, ref_logits = HfReference(ref).greedy(prompt, steps)
    _, tokens, logits = greedy_run(make_executor(path, gguf_dequantize=True), prompt, steps)
    _, dir_tokens, dir_logits = greedy_run(make_executor(ref), prompt, steps)
    assert tokens == dir_tokens == ref_tokens
    assert all(torch.equal(o, d) for o, d in zip(logits, dir_logits))
    return max(rel_err(o, r) for o, r in zip(logits, ref_logits))


@pytest.mark.parametrize("qtype", QTYPES)
def test_llama_in_every_type_equals_transformers_on_its_weights(checkpoint, tmp_path, qtype):
    path, state, ref = gguf_and_reference(checkpoint, tmp_path, "llama", qtype)
    model = load_model(path, progress=False, gguf_dequantize=True)
    ours = model.state_dict()
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(ours["model.layers.0.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))  # un-permuted
    assert torch.equal(ours["model.layers.1.mlp.down_proj.weight"], state["model.layers.1.mlp.down_proj.weight"])
    err = parity(path, ref)
    print(f"llama {qtype}: max relative logits error {err:.2e}")
    assert err < TOLERANCE


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K", "Q6_K"])
def test_each_family_equals_transformers_on_its_weights(checkpoint, tmp_path, family, qtype):
    path, _, ref = gguf_and_reference(checkpoint, tmp_path, family, qtype)
    err = parity(path, ref, prompt_len=40)  # past Gemma's 16-token window
    print(f"{family} {qtype}: max relative logits error {err:.2e}")
    assert err < TOLERANCE


@pytest.mark.parametrize("scaling", ["linear", "yarn", "llama3"])
def test_rope_scaling_equals_transformers(tiny_checkpoint, tmp_path, scaling):
    """linear and yarn as rope.scaling.* keys; Llama 3.1's as the rope_freqs tensor (its parameters recovered)."""
    hf_dir = tiny_checkpoint("llama", rope_scaling=scaling, config_overrides=WIDE)
    path, _ = write_gguf(hf_dir, tmp_path / f"{scaling}.gguf", "F32")
    err = parity(path, hf_dir, prompt_len=90)  # past the 64-token original length the scalings use
    assert err < TOLERANCE


def test_a_mistral_file_that_records_its_window_slides(checkpoint, tmp_path):
    hf_dir = make_family_checkpoint("mistral", tmp_path / "hf", sliding_window=16)
    checkpoint("mistral")  # skips where models/ does not serve Mistral
    path, state = write_gguf(hf_dir, tmp_path / "m.gguf", "Q8_0", mistral_window=True)
    gguf = GgufFile(path)
    raw = hf_config(gguf.metadata, gguf.tensor_shapes, gguf.tensor_types, "m.gguf")
    assert raw["architectures"] == ["MistralForCausalLM"] and raw["sliding_window"] == 16
    assert parity(path, reference_dir(hf_dir, state, tmp_path / "reference"), prompt_len=40) < TOLERANCE


def test_the_config_equals_the_hf_directorys(checkpoint, tmp_path):
    for family in ("llama", "qwen2", "qwen3"):
        path, _ = write_gguf(checkpoint(family), tmp_path / f"{family}.gguf", "Q8_0")
        gguf = GgufFile(path)
        ours = ModelConfig.from_hf(hf_config(gguf.metadata, gguf.tensor_shapes, gguf.tensor_types, "x"))
        want = ModelConfig.from_dir(checkpoint(family))
        assert ours == want.__class__(**{**want.__dict__, "torch_dtype": "bfloat16"}), family


def test_dtype_and_int8_quantization_apply(checkpoint, tmp_path):
    path, state, ref = gguf_and_reference(checkpoint, tmp_path, "qwen2", "Q4_1")
    assert str(load_model(path, progress=False, dtype="bfloat16").lm_head.weight.dtype) == "torch.bfloat16"
    ex = make_executor(path, quantization="int8", gguf_dequantize=True)
    assert ex.info().dtype == "float32" and ex.info().quantization == "int8"
    prompt = prompt_of(16, seed=5)
    _, tokens, logits = greedy_run(ex, prompt, 3)
    _, want_tokens, want_logits = greedy_run(make_executor(ref, quantization="int8"), prompt, 3)
    assert tokens == want_tokens and max(rel_err(o, r) for o, r in zip(logits, want_logits)) < 1e-6


def test_qk_permutation_round_trips():
    rng = np.random.default_rng(0)
    for n_head, rows in ((9, 576), (3, 192), (4, 256)):
        w = rng.standard_normal((rows, 8)).astype(np.float32)
        stored = llama_cpp_permute(w, n_head)
        assert not np.array_equal(stored, w)
        np.testing.assert_array_equal(permute_rope_rows(w, n_head), stored)
        np.testing.assert_array_equal(unpermute_rope_rows(stored, n_head), w)
        bias = w[:, 0]
        np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(bias, n_head), n_head), bias)


def _meta(**extra):
    base = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.block_count": 2, "llama.feed_forward_length": 128}
    return {**base, **extra}


SHAPES = {"token_embd.weight": (448, 64)}


@pytest.mark.parametrize("meta, shapes, message", [
    ({**_meta(), "general.architecture": "falcon"}, SHAPES, "general.architecture='falcon'"),
    (_meta(**{"llama.attention.clamp_kqv": 8.0}), SHAPES, "'llama.attention.clamp_kqv'"),
    (_meta(**{"llama.expert_count": 8}), SHAPES, "llama.expert_count=8"),
    (_meta(**{"llama.rope.dimension_count": 8}), SHAPES, "rope.dimension_count=8"),
    (_meta(**{"llama.rope.scaling.type": "longrope"}), SHAPES, "rope.scaling.type='longrope'"),
    (_meta(**{"llama.attention.head_count_kv": [2, 4]}), SHAPES, "llama.attention.head_count_kv is a per-layer"),
    (_meta(**{"split.count": 2}), SHAPES, "split.count"),
    (_meta(), {**SHAPES, "rope_freqs.weight": (32,)}, "rope_freqs.weight"),
    (_meta(), {}, "token_embd.weight"),
])
def test_metadata_it_cannot_honour_is_an_error_naming_it(meta, shapes, message):
    with pytest.raises(CheckpointError) as exc:
        hf_config(meta, shapes, {}, "m.gguf")
    assert message in str(exc.value)


def test_a_file_that_is_not_gguf_is_a_checkpoint_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="cannot read it as a GGUF file"):
        load_model(bad, progress=False)
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        load_model(tmp_path / "missing.gguf", progress=False)


def test_gemma3_reads_the_sliding_pattern_and_local_rope_base_newer_files_write():
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 64, "gemma3.attention.head_count": 4,
            "gemma3.block_count": 3, "gemma3.feed_forward_length": 128, "gemma3.rope.freq_base_swa": 5000.0,
            "gemma3.attention.sliding_window_pattern": [True, False, True]}
    raw = hf_config(meta, SHAPES, {}, "m.gguf")
    assert raw["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert raw["rope_parameters"]["sliding_attention"]["rope_theta"] == 5000.0
    with pytest.raises(CheckpointError, match="sliding_window_pattern"):
        hf_config({**meta, "gemma3.attention.sliding_window_pattern": [True]}, SHAPES, {}, "m.gguf")


@pytest.mark.parametrize("factor, head_dim", [(8.0, 128), (32.0, 64)])  # Llama 3.1 8B, Llama 3.2 1B
def test_llama3_rope_parameters_come_back_exactly_from_rope_freqs(factor, head_dim):
    from models.gguf.config import _llama3_factors, _llama3_rope

    want = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    stored = _llama3_factors(500000.0, head_dim, want).astype(np.float32)  # the tensor is float32
    assert _llama3_rope(stored.astype(np.float64), 500000.0, head_dim, "m.gguf") == want
    with pytest.raises(CheckpointError, match="not Llama 3.1-style"):
        _llama3_rope(np.linspace(1, factor, head_dim // 2), 500000.0, head_dim, "m.gguf")
