"""Tiny GGUF files written at test time from tiny random HF checkpoints, the way llama.cpp's
convert_hf_to_gguf.py writes them (names, Q/K row permutation for Llama-arch files, Gemma norms as 1 + w,
metadata keys, the byte-level BPE tokenizer), with every matrix in one GGML type.

Written independently of models/gguf_*.py (its own name table and permutation), so that reading a file back
tests those modules rather than repeating them. `write_gguf` also returns the HF state the file's weights
dequantize to, and `reference_dir` writes it as an HF directory: transformers run on exactly the weights the
GGUF holds is the reference for the quantized types.

gguf 0.19 quantizes F16, BF16, Q8_0, Q4_0 and Q4_1 but not the K-quants (its Q4_K/Q5_K/Q6_K quantize raises
NotImplementedError): for those the file holds random valid blocks (scales chosen so that the weights have the
tiny models' spread), and the reference is their dequantized values.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, quants
from safetensors.torch import load_file, save_file

QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
             "gemma2": "gemma2", "gemma3_text": "gemma3"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_LAYER_GEMMA2 = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# (offsets of the float16 scales d / dmin in a block, target weight std) per K-quant
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
WEIGHT_STD = 0.2


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, gguf_arch: str) -> str:
    table = _LAYER_GEMMA2 if gguf_arch in ("gemma2", "gemma3") else _LAYER
    stem, _, kind = hf.rpartition(".")
    if stem.startswith("model.layers."):
        layer, _, part = stem[len("model.layers."):].partition(".")
        return f"blk.{layer}.{table[part]}.{kind}"
    return f"{_GLOBAL[stem]}.{kind}"


def _quantized(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str]:
    """(data to store, the float32 values it dequantizes to, the type stored) for an HF-layout matrix."""
    gtype = GGMLQuantizationType[qtype]
    block, _ = quants.GGML_QUANT_SIZES[gtype]
    if qtype == "F32" or w.shape[-1] % block:  # llama.cpp also keeps rows it cannot block-quantize wider
        return w, w, "F32"
    if qtype == "F16":
        half = w.astype(np.float16)
        return half, half.astype(np.float32), qtype
    if qtype in K_QUANTS:
        data = _random_k_blocks(w.shape, gtype, rng)
    else:
        data = quants.quantize(w, gtype)
    return data, quants.dequantize(data, gtype).reshape(w.shape).astype(np.float32), qtype


def _random_k_blocks(shape: tuple[int, ...], gtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    block, size = quants.GGML_QUANT_SIZES[gtype]
    data = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    offsets = _K_SCALES[gtype.name]
    for off in offsets:  # unit scales first, to measure the spread of the quants
        data[..., off:off + 2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    spread = float(quants.dequantize(data.reshape(shape[0], -1), gtype).std())
    scale = np.frombuffer(np.float16(WEIGHT_STD / spread).tobytes(), dtype=np.uint8)
    for off in offsets:
        data[..., off:off + 2] = scale
    return data.reshape(shape[0], -1)


def write_gguf(hf_dir: Path, out: Path, qtype: str, pre: str = "qwen2", seed: int = 0,
               mistral_window: bool = False) -> tuple[Path, dict]:
    """Writes the model of `hf_dir` as GGUF file `out`, matrices in `qtype`; returns (out, HF state dict of the
    weights the file holds, float32). mistral_window: record a Mistral's sliding_window (llama.cpp's converter
    does not; other writers may)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base((rope.get("full_attention") or rope).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    rope_tensor = _add_rope_scaling(w, rope, head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(0)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch in ("gemma2", "gemma3") or (mistral_window and cfg["model_type"] == "mistral"):
        w.add_sliding_window(cfg["sliding_window"])
    _add_tokenizer(w, hf_dir, pre, cfg["vocab_size"])

    rng = np.random.default_rng(seed)
    state = {k: v.float().numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    effective: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        stored, eff, stored_type = (value, value, "F32") if value.ndim == 1 else _quantized(value, qtype, rng)
        effective[name] = torch.from_numpy(np.ascontiguousarray(eff))
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):  # rows permuted, whatever their type
            stored = llama_cpp_permute(stored, heads if ".q_proj." in name else kv_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            stored = stored + np.float32(1.0)
        raw = None if stored_type in ("F32", "F16") else GGMLQuantizationType[stored_type]
        w.add_tensor(gguf_name(name, arch), np.ascontiguousarray(stored), raw_dtype=raw)
    if rope_tensor is not None:
        w.add_tensor("rope_freqs.weight", rope_tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out, effective


def _add_rope_scaling(w: GGUFWriter, rope: dict, head_dim: int) -> np.ndarray | None:
    """What convert_hf_to_gguf writes for rope scaling: linear/yarn as rope.scaling.* keys; llama3 as the
    rope_freqs tensor of per-dimension divisors (LlamaModel.generate_extra_tensors), no key."""
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(RopeScalingType(kind))
        w.add_rope_scaling_factor(rope["factor"])
        if kind == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        return None
    if kind != "llama3":
        return None
    base, factor = rope["rope_theta"], rope["factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tokenizer(w: GGUFWriter, hf_dir: Path, pre: str, vocab_size: int) -> None:
    """The byte-level BPE of hf_dir's tokenizer.json as convert_hf_to_gguf writes a gpt2 vocab: every id up to
    vocab_size (padding ids as [PADn] user-defined tokens), added tokens as control tokens."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok["added_tokens"]}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(3 if added[i]["special"] else 4)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(1)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(4)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = tok["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    ids = {t: i for i, t in enumerate(tokens)}
    w.add_bos_token_id(ids[tok_cfg["bos_token"]])
    w.add_eos_token_id(ids[tok_cfg["eos_token"]])
    w.add_unk_token_id(ids[tok_cfg["unk_token"]])
    w.add_pad_token_id(ids[tok_cfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])


def reference_dir(hf_dir: Path, state: dict[str, torch.Tensor], out: Path) -> Path:
    """A copy of hf_dir whose weights are `state` (what the GGUF file holds)."""
    shutil.copytree(hf_dir, out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# Families the loader reads from GGUF beyond the tiny_checkpoint fixture's: (transformers config class, class).
FAMILY_CLASSES = {"mistral": ("MistralConfig", "MistralForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
                  "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def make_family_checkpoint(family: str, out: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random HF checkpoint of a family (transformers' own config class), with the tiny tokenizer.
    Mistral keeps a window past the tests' lengths (llama.cpp writes Mistral as a Llama, without its window);
    Gemma scales queries by head_dim (llama.cpp's assumption below 27B) and slides over 16 tokens."""
    import transformers

    from tests.conftest import load_script

    maker = load_script("make_tiny_checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    vocab = -(-maker._write_tokenizer(out) // maker.VOCAB_MULTIPLE) * maker.VOCAB_MULTIPLE
    kw = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=maker.BOS_ID, eos_token_id=maker.EOS_ID, pad_token_id=maker.PAD_ID)
    if family == "mistral":
        kw.update(sliding_window=4096, tie_word_embeddings=False)
    else:
        kw.update(query_pre_attn_scalar=64, sliding_window=16)
    if family == "gemma3":
        kw["num_hidden_layers"] = 6  # five sliding layers, then a global one
    kw.update(overrides)
    cfg_cls, model_cls = FAMILY_CLASSES[family]
    config = getattr(transformers, cfg_cls)(**kw)
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    maker._reinit_(model, seed, maker.WEIGHT_STD)
    model.save_pretrained(out, safe_serialization=True)
    return out
