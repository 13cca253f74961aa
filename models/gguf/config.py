"""GGUF metadata -> the HF `config.json` dict the same model would have, so that the one config parser
(models/config.py ModelConfig.from_hf) makes the ModelConfig, as for an HF directory.

Every `{arch}.*` key is either understood here or an error naming it (as an unknown config.json field is):
a file whose metadata asks for something Tandem does not do (MoE experts in a llama file, partial rotary,
per-layer head counts, an unknown rope scaling) is refused at load, never served wrongly. `general.*`,
`tokenizer.*`, `quantize.*` (imatrix notes) and the GGUF header keys are descriptive and pass.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from tandem.errors import CheckpointError

# general.architecture -> (HF architectures[0], HF model_type). llama.cpp writes Mistral as "llama".
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
GEMMA = ("gemma", "gemma2", "gemma3")
# llama.cpp's fixed settings for Gemma (llama-model.cpp): 2 = every other layer slides (layer 0 does), 6 =
# five sliding layers then a global one; Gemma 3's sliding layers use rope base 10000.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# llama.cpp scales Gemma 2/3 27B queries by hidden/heads instead of head_dim; it tells 27B by its layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

_COMMON_KEYS = {
    "context_length", "embedding_length", "feed_forward_length", "block_count", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "expert_count", "expert_used_count",  # accepted only as 0 (dense)
}
_ARCH_KEYS = {
    "llama": {"attention.sliding_window"},  # a Mistral with its window -> MistralForCausalLM
    "gemma2": {"attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"},
    "gemma3": {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa"},
}
_DESCRIPTIVE_PREFIXES = ("general.", "tokenizer.", "quantize.", "GGUF.")

# Dominant weight type -> the checkpoint dtype `--dtype auto` keeps on CUDA (CPU runs float32 anyway).
# Quantized weights become bfloat16: the safe range for activations (Gemma overflows float16).
_DTYPE_OF_TYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def hf_config(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
              tensor_types: dict[str, str], source: str, rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """The config.json dict of the model in a GGUF file: `meta` its metadata, `tensor_shapes` / `tensor_types`
    its tensors (numpy-order shapes, GGML type names), `rope_freqs` the values of its rope_freqs tensor if it
    has one; CheckpointError naming what cannot be honoured."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{source}: unsupported GGUF architecture general.architecture={arch!r}; Tandem "
                              f"serves GGUF files of {', '.join(ARCHITECTURES)}")
    _check_keys(meta, arch, source)

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if required and value is None:
            raise CheckpointError(f"{source}: missing metadata {arch}.{key}")
        if isinstance(value, list):
            raise CheckpointError(f"{source}: {arch}.{key} is a per-layer list {value[:4]}...; Tandem needs "
                                  "one value for every layer")
        return value

    for key in ("expert_count", "expert_used_count"):
        if get(key, 0):
            raise CheckpointError(f"{source}: {arch}.{key}={get(key)}: mixture-of-experts GGUF files are not "
                                  "supported (serve the HF checkpoint)")
    if "rope_freqs.weight" in tensor_shapes and rope_freqs is None:
        raise CheckpointError(f"{source}: tensor 'rope_freqs.weight' (per-dimension rope factors) was not read")
    hidden, heads = int(get("embedding_length", required=True)), int(get("attention.head_count", required=True))
    head_dim = int(get("attention.key_length") or hidden // heads)
    if int(get("attention.value_length") or head_dim) != head_dim:
        raise CheckpointError(f"{source}: {arch}.attention.value_length={get('attention.value_length')} differs "
                              f"from the key length {head_dim}")
    if int(get("rope.dimension_count") or head_dim) != head_dim:
        raise CheckpointError(f"{source}: {arch}.rope.dimension_count={get('rope.dimension_count')}: partial "
                              f"rotary embeddings (head_dim {head_dim}) are not supported")
    layers = int(get("block_count", required=True))
    if "token_embd.weight" not in tensor_shapes:
        raise CheckpointError(f"{source}: missing tensor 'token_embd.weight'")
    hf_arch, model_type = ARCHITECTURES[arch]
    theta = float(get("rope.freq_base") or 10000.0)
    rope = {"rope_type": "default", "rope_theta": theta, **_rope_scaling(get, arch, source)}
    if rope_freqs is not None:
        rope.update(_llama3_rope(np.asarray(rope_freqs, dtype=np.float64), theta, head_dim, source))
    raw: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": tensor_shapes["token_embd.weight"][0], "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": head_dim, "max_position_embeddings": int(get("context_length") or 2048),
        # stored as float32 (9.99999974e-06 for 1e-5): the shortest decimal that rounds to it
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta, "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "torch_dtype": _checkpoint_dtype(tensor_types), "hidden_act": "silu",
        **_token_ids(meta),
    }
    if arch in GEMMA:
        raw.update(_gemma(meta, get, arch, raw, rope, source))
    elif arch == "llama" and get("attention.sliding_window"):
        raw.update(architectures=["MistralForCausalLM"], model_type="mistral",
                   sliding_window=int(get("attention.sliding_window")))
    return raw


def _check_keys(meta: dict[str, Any], arch: str, source: str) -> None:
    known = _COMMON_KEYS | _ARCH_KEYS.get(arch, set())
    for key in meta:
        if key.startswith(_DESCRIPTIVE_PREFIXES):
            continue
        if key.startswith("split."):
            raise CheckpointError(f"{source}: {key}: split GGUF files are not supported (merge them with "
                                  "llama.cpp's gguf-split --merge)")
        suffix = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        if suffix not in known:
            raise CheckpointError(f"{source}: GGUF metadata {key!r} is not supported for {arch} models")


def _rope_scaling(get: Callable[..., Any], arch: str, source: str) -> dict[str, Any]:
    kind = get("rope.scaling.type") or "none"
    factor = get("rope.scaling.factor")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = get("rope.scaling.original_context_length")
        if not original or not factor:
            raise CheckpointError(f"{source}: yarn rope scaling needs {arch}.rope.scaling.factor and "
                                  f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    raise CheckpointError(f"{source}: {arch}.rope.scaling.type={kind!r} is not supported (none, linear, yarn)")


def _llama3_factors(theta: float, head_dim: int, p: dict[str, Any]) -> np.ndarray:
    """The per-dimension divisors of Llama 3.1's rope (what llama.cpp's converter stores as rope_freqs)."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
        p["high_freq_factor"] - p["low_freq_factor"])
    medium = 1 / ((1 - smooth) / p["factor"] + smooth)
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, p["factor"], medium))


def _llama3_rope(factors: np.ndarray, theta: float, head_dim: int, source: str) -> dict[str, Any]:
    """Llama 3.1's rope scaling from the rope_freqs tensor: the divisors rise from 1 to `factor` linearly in
    1/wavelength between two wavelengths; the line through the rising ones gives low/high_freq_factor for an
    original length of 8192 (only their ratios matter: Llama 3.x's real values come back exactly). Any other
    shape is an error, not an approximation."""
    if factors.shape != (head_dim // 2,):
        raise CheckpointError(f"{source}: rope_freqs has {factors.shape[0]} values; head_dim {head_dim} needs "
                              f"{head_dim // 2}")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return {}
    rising = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    inv_wavelen = 1 / (2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    params: dict[str, Any] = {"rope_type": "llama3", "factor": factor, "original_max_position_embeddings": 8192}
    if rising.sum() >= 2:
        smooth = (1 / factors[rising] - 1 / factor) / (1 - 1 / factor)
        slope, offset = np.polyfit(inv_wavelen[rising], smooth, 1)  # smooth = (old/wavelen - low) / (high - low)
        span = 8192 / slope
        params.update(low_freq_factor=float(f"{-offset * span:.6g}"),
                      high_freq_factor=float(f"{-offset * span + span:.6g}"))
        if np.allclose(_llama3_factors(theta, head_dim, params), factors, rtol=1e-4):
            return params
    raise CheckpointError(f"{source}: tensor 'rope_freqs.weight' is not Llama 3.1-style rope scaling (factors "
                          f"{np.round(factors[:4], 4).tolist()}...); Tandem cannot honour it")


def _gemma(meta: dict[str, Any], get: Callable[..., Any], arch: str, raw: dict[str, Any], rope: dict[str, Any],
           source: str) -> dict[str, Any]:
    """What Gemma configs say beyond Llama's (transformers 5's spelling): tied embeddings, tanh GELU, and for
    Gemma 2/3 the sliding layers, soft-capping and query scale llama.cpp assumes."""
    out: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma":
        return out
    layers, head_dim = raw["num_hidden_layers"], raw["head_dim"]
    # newer converters write the pattern: a period, or one flag per layer (true = sliding)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _SWA_PATTERN[arch])
    if isinstance(pattern, list) and len(pattern) == layers:
        sliding = [bool(p) for p in pattern]
    elif isinstance(pattern, int) and pattern > 0:
        sliding = [i % pattern < pattern - 1 for i in range(layers)]
    else:
        raise CheckpointError(f"{source}: {arch}.attention.sliding_window_pattern={pattern!r} is neither a period "
                              f"nor one flag per layer ({layers})")
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    out["sliding_window"] = int(get("attention.sliding_window") or 4096)
    big = layers == _GEMMA_27B_LAYERS[arch]
    out["query_pre_attn_scalar"] = raw["hidden_size"] // raw["num_attention_heads"] if big else head_dim
    if arch == "gemma2":
        out["attn_logit_softcapping"] = _f32(get("attn_logit_softcapping", 50.0))
        out["final_logit_softcapping"] = _f32(get("final_logit_softcapping", 30.0))
    else:
        local_base = float(get("rope.freq_base_swa") or _GEMMA3_LOCAL_ROPE_BASE)
        if isinstance(pattern, int):
            out["_sliding_window_pattern"] = pattern
        out["rope_local_base_freq"] = local_base
        out["rope_parameters"] = {"full_attention": rope,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": local_base}}
        if rope.get("rope_type") != "default":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def _token_ids(meta: dict[str, Any]) -> dict[str, Any]:
    """bos/eos from the tokenizer metadata; end-of-turn / end-of-message ids stop generation too (llama.cpp
    treats them as end of generation; HF configs list them among eos_token_id)."""
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id")]
    eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
    out: dict[str, Any] = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
                           "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)}
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        out["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return out


def _checkpoint_dtype(tensor_types: dict[str, str]) -> str:
    """The dtype of the file's matrices: float32/float16/bfloat16 when they are all that; quantized -> bfloat16."""
    matrix_types = {t for n, t in tensor_types.items() if not n.endswith(("norm.weight", ".bias"))}
    if len(matrix_types) == 1 and next(iter(matrix_types)) in _DTYPE_OF_TYPE:
        return _DTYPE_OF_TYPE[next(iter(matrix_types))]
    return "bfloat16" if matrix_types else "float32"


def _f32(value: float) -> float:
    return float(f"{float(value):.6g}")
