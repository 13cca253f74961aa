"""What every family shares: the Llama layout's config.json fields (Llama, Qwen2, Qwen3 and Qwen3-MoE are
exactly this), and the checks family files use to refuse what they do not understand."""
from __future__ import annotations

from typing import Any

from models.quant.prequantized import read_scheme
from models.rope_config import RopeConfig
from tandem.errors import CheckpointError

QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def need(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw or raw[key] is None:
        raise CheckpointError(f"{source}: missing required field {key!r}")
    return raw[key]


def refuse(raw: dict[str, Any], source: str, key: str, allowed: tuple, why: str) -> None:
    """A config field whose value the model code does not implement is an error naming it (unset = allowed)."""
    value = raw.get(key)
    if value is not None and value not in allowed:
        raise CheckpointError(f"{source}: {key}={value!r} is not supported ({why})")


def activation(raw: dict[str, Any], source: str, key: str = "hidden_act") -> str:
    """The MLP activation by transformers' ACT2FN name -> ours (silu | gelu_tanh)."""
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    value = raw.get(key) or "silu"
    if value not in names:
        raise CheckpointError(f"{source}: {key}={value!r} is not supported (Tandem's MLPs: {', '.join(names)})")
    return names[value]


def rope_from_hf(raw: dict[str, Any], params: dict[str, Any] | None = None) -> RopeConfig:
    """transformers 5 writes `rope_parameters` (theta inside); older configs write rope_theta + rope_scaling.
    params: one layer type's entry of a per-layer-type rope_parameters (Gemma 3)."""
    if params is None:
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    else:
        params = dict(params)
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if kind in ("llama3", "yarn", "longrope", "su") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = raw.get(
            "original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
    if "partial_rotary_factor" in raw and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = raw["partial_rotary_factor"]
    return RopeConfig(theta=theta, kind=str(kind), params=params)


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """ModelConfig's fields for the Llama layout (and Qwen2/Qwen3/Qwen3-MoE, which are it)."""
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        raise CheckpointError(f"{source}: sliding-window attention (use_sliding_window) is not supported "
                              f"for {arch}")
    if raw.get("quantization_config") is not None:  # AWQ / GPTQ / compressed-tensors load as blocks, or this refuses
        read_scheme(raw["quantization_config"], source)
    hidden = int(need(raw, "hidden_size", source))
    heads = int(need(raw, "num_attention_heads", source))
    head_dim = raw.get("head_dim") or hidden // heads
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    bias = arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
    fields = dict(
        architecture=arch,
        model_type=raw.get("model_type", ""),
        vocab_size=int(need(raw, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(need(raw, "intermediate_size", source)),
        num_layers=int(need(raw, "num_hidden_layers", source)),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias; Llama-family configs say so with attention_bias (o_proj too).
        attention_bias=bias,
        o_bias=bias and arch != "Qwen2ForCausalLM" and arch not in QWEN3,
        qk_norm=arch in QWEN3,
        rope=rope_from_hf(raw),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        hidden_act=activation(raw, source),
        mlp_bias=bool(raw.get("mlp_bias", False)),
    )
    if arch == "Qwen3MoeForCausalLM":
        fields.update(moe_fields(raw, source, "num_experts", "moe_intermediate_size"))
        fields.update(norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                      decoder_sparse_step=int(raw.get("decoder_sparse_step", 1) or 1),
                      mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()))
    return fields


def moe_fields(raw: dict[str, Any], source: str, experts_key: str, inter_key: str) -> dict[str, Any]:
    """num_experts, num_experts_per_tok and the experts' intermediate size, checked."""
    experts = raw.get(experts_key, raw.get("num_local_experts"))
    top_k, inter = raw.get("num_experts_per_tok"), raw.get(inter_key)
    if not experts or not top_k or not inter or not 0 < int(top_k) <= int(experts):
        raise CheckpointError(f"{source}: a MoE model needs {experts_key}, num_experts_per_tok (1..experts) and "
                              f"{inter_key}; got {experts!r}, {top_k!r}, {inter!r}")
    return {"num_experts": int(experts), "num_experts_per_tok": int(top_k), "moe_intermediate_size": int(inter)}


def sliding_fields(raw: dict[str, Any], source: str, layers: int, max_pos: int) -> dict[str, Any]:
    """sliding_window and layer_types, checked. A window that covers max_position_embeddings slides nothing."""
    window = raw.get("sliding_window")
    types = tuple(raw.get("layer_types") or ())
    if types and len(types) != layers:
        raise CheckpointError(f"{source}: layer_types lists {len(types)} layers, num_hidden_layers is {layers}")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise CheckpointError(f"{source}: layer_types {sorted(unknown)} are not supported "
                              "(sliding_attention, full_attention)")
    if window is None or int(window) >= max_pos:
        return {"sliding_window": None, "layer_types": ()}
    if int(window) < 1:
        raise CheckpointError(f"{source}: sliding_window must be positive, got {window!r}")
    return {"sliding_window": int(window), "layer_types": types}
