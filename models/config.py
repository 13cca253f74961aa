"""ModelConfig: the architecture facts Tandem needs, read from an HF `config.json`."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. `kind` is transformers' rope_type: default, linear, dynamic, yarn, llama3."""

    theta: float = 10000.0
    kind: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, beta_fast, ...


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2, some Llamas)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope: RopeConfig
    torch_dtype: str  # dtype the checkpoint was saved in ("float32", "bfloat16", ...)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE); num_experts 0 = a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' Qwen3MoeDecoderLayer rule: sparse unless listed in mlp_only_layers, every
        decoder_sparse_step-th layer."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: not found; a model directory needs an HF config.json")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read it as JSON: {exc}") from exc
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"Tandem serves {', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("use_sliding_window"):
            raise CheckpointError(f"{source}: sliding-window attention (use_sliding_window) is not supported")

        def need(key: str) -> Any:
            if key not in raw:
                raise CheckpointError(f"{source}: missing required field {key!r}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = raw.get("head_dim") or hidden // heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        model_type = raw.get("model_type", "")
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama-family configs say so with attention_bias.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope=_rope_from_hf(raw),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            **_moe_from_hf(raw, arch, source),
        )


def _moe_from_hf(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    if arch != "Qwen3MoeForCausalLM":
        return {}
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    top_k, inter = raw.get("num_experts_per_tok"), raw.get("moe_intermediate_size")
    if not experts or not top_k or not inter or not 0 < int(top_k) <= int(experts):
        raise CheckpointError(f"{source}: Qwen3-MoE needs num_experts, num_experts_per_tok (1..num_experts) and "
                              f"moe_intermediate_size; got {experts!r}, {top_k!r}, {inter!r}")
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    return {"num_experts": int(experts), "num_experts_per_tok": int(top_k), "moe_intermediate_size": int(inter),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)), "decoder_sparse_step": step,
            "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ())}


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs write rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if kind in ("llama3", "yarn") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = raw.get(
            "original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
    return RopeConfig(theta=theta, kind=str(kind), params=params)


@dataclass(frozen=True)
class GenerationDefaults:
    """What `generation_config.json` says about stopping (falls back to config.json's ids)."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


def read_generation_defaults(model_dir: str | Path, cfg: ModelConfig) -> GenerationDefaults:
    path = Path(model_dir) / "generation_config.json"
    raw: dict[str, Any] = {}
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read it as JSON: {exc}") from exc
    eos = raw.get("eos_token_id", list(cfg.eos_token_ids))
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    return GenerationDefaults(raw.get("bos_token_id", cfg.bos_token_id), eos_ids)
