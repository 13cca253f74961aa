"""ModelConfig: the architecture facts Tandem needs, read from an HF `config.json`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.families import FAMILIES
from models.rope_config import RopeConfig
from models.vision.config import VisionConfig
from tandem.errors import CheckpointError

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)  # (models/families/)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the model code reads. The fields after `eos_token_ids` say how a family differs
    from the Llama layout (their defaults are Llama's); models/families/ reads them from config.json."""

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
    # Mixture of experts (Qwen3-MoE, Mixtral, GPT-OSS); num_experts 0 = a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    moe_style: str = "qwen"  # qwen: softmax then top-k; gpt_oss: top-k of the logits then softmax, biases,
    # interleaved gate/up and the clamped SwiGLU (models/moe.py)
    swiglu_limit: float = 0.0  # gpt_oss: the clamp of gate (above) and up (both sides)
    swiglu_alpha: float = 1.702  # gpt_oss: glu = gate * sigmoid(alpha * gate)
    # Attention
    sliding_window: int | None = None  # keys a sliding layer's query sees: its own and the window - 1 before
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" | "full_attention"; () = all the same:
    # sliding when sliding_window is set, else full
    attn_scale: float | None = None  # scores = q.k * attn_scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores = cap * tanh(scores / cap) before the mask (Gemma 2)
    attention_sinks: bool = False  # a learned per-head logit joins every softmax (GPT-OSS)
    o_bias: bool = False  # the attention output projection has a bias
    qk_norm_whole: bool = False  # q/k RMSNorm over the whole projection, not per head (OLMo 2)
    local_rope: RopeConfig | None = None  # sliding layers' own rotary settings (Gemma 3); None: `rope`
    rope_layers: tuple[bool, ...] = ()  # per layer whether it applies RoPE (SmolLM3's NoPE layers); () = all
    # Norms, residuals, scales
    layout: str = "pre"  # pre: norm before attention and MLP (Llama); sandwich: also after each (Gemma 2/3);
    # post: only after each (OLMo 2)
    norm_offset: bool = False  # RMSNorm multiplies by (1 + weight) (Gemma)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden); Granite: embedding_multiplier)
    residual_scale: float = 1.0  # each sublayer's output times this before the residual add (Granite)
    logits_divisor: float = 1.0  # logits / this (Granite's logits_scaling)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_tanh
    mlp_bias: bool = False  # the dense MLP's projections have biases
    quantized_experts: str = ""  # how the checkpoint stores expert weights: "" (as floats) | "mxfp4"
    # A *ForSequenceClassification checkpoint (models/families/classifier.py): its config.json architecture
    # (`architecture` is then the causal family's, whose layout it has) and its `score` head's outputs; no LM
    # head of its own. "" and 0 for a causal LM.
    checkpoint_architecture: str = ""
    num_labels: int = 0
    # A vision-language checkpoint (models/families/idefics3.py): where its text tower's tensors sit (our
    # `model.X` is read as `<prefix>X`; "" = as named) and its vision tower (None: a text-only model).
    checkpoint_text_prefix: str = ""
    vision: VisionConfig | None = None
    # M-RoPE (Qwen2.5-VL): rotary frequencies turned by the temporal, height and width position of each token
    # (three counts, summing to rotary_dim / 2; executor_service/vision/mrope.py); () = one position per token
    mrope_section: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' Qwen3MoeDecoderLayer rule: sparse unless listed in mlp_only_layers, every
        decoder_sparse_step-th layer."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of this layer's attention (None: it sees the whole sequence)."""
        if self.sliding_window is None:
            return None
        if not self.layer_types or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides: a sequence then needs only its last window of KV (the paged
        cache frees blocks that left it). None when any layer sees the whole sequence."""
        windows = {self.window_of(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 and None not in windows else None

    def rope_of(self, layer: int) -> RopeConfig | None:
        """The rotary settings of this layer (None: it applies no RoPE)."""
        if self.rope_layers and not self.rope_layers[layer]:
            return None
        if self.local_rope is not None and self.window_of(layer) is not None:
            return self.local_rope
        return self.rope

    @property
    def native_decode_refusal(self) -> str | None:
        """Why the native C++ decode step (models/decode/native.py) cannot run this architecture: it runs the
        Llama layout (pre-norm, per-head q/k norm, SiLU MLP, full attention with the default scale, one rope)
        and nothing else. None when the architecture is that layout (MoE and machine facts are checked there)."""
        facts = [
            (self.sliding_window is not None and any(self.window_of(i) for i in range(self.num_layers)),
             "sliding-window attention"),
            (self.attn_softcap is not None or self.final_softcap is not None, "soft-capping"),
            (bool(self.mrope_section), "M-RoPE (three positions per token)"),
            (self.attention_sinks, "attention sinks"),
            (self.attn_scale is not None, "an attention scale other than head_dim ** -0.5"),
            (self.layout != "pre", f"the {self.layout}-norm layer layout"),
            (self.norm_offset, "RMSNorm with (1 + weight)"),
            (self.qk_norm_whole, "q/k norms over the whole projection"),
            (self.embed_scale != 1.0 or self.residual_scale != 1.0 or self.logits_divisor != 1.0,
             "embedding, residual or logits multipliers"),
            (self.hidden_act != "silu", f"the {self.hidden_act} MLP activation"),
            (self.o_bias or self.mlp_bias, "biases on the output or MLP projections"),
            (bool(self.rope_layers) and not all(self.rope_layers), "layers without RoPE"),
            (self.local_rope is not None, "per-layer rotary settings"),
            (float(self.rope.params.get("partial_rotary_factor", 1.0)) != 1.0, "partial rotary embeddings"),
            (self.rope.kind in ("longrope", "su"), "LongRoPE's per-position factors"),
        ]
        return next((why for applies, why in facts if applies), None)

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
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"Tandem serves {', '.join(FAMILIES)}")
        return cls(**FAMILIES[arch](raw, arch, source))


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
