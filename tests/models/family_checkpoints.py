"""Tiny random checkpoints of the model families beyond Llama/Qwen, written by transformers itself
from its own config classes (no downloads), with the tiny trained tokenizer of scripts/make_tiny_checkpoint.py.

Each family's settings make what differs from Llama visible in the logits: small windows (prompts and
generations run past them), soft caps small enough that tanh bends, multipliers far from 1, a NoPE layer,
local/global rope bases, biased experts with the SwiGLU clamp reached. Test-only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WINDOW = 24  # sliding window of the windowed families: not a multiple of the 16-token block

# family -> (config class, architecture, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=WINDOW,
                     head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=3.0,
                    final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, num_hidden_layers=3,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 1_000_000.0}},
                    tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(original_max_position_embeddings=64,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                                   "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                   "long_factor": [1.5 + 0.3 * i for i in range(8)],
                                   "original_max_position_embeddings": 64})),
    # Phi-3 with plain rope is the Llama layout after loading (fused q/k/v and gate/up split): the native
    # decode step applies to it.
    "phi3_plain": ("Phi3Config", "Phi3ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=3.0, attention_multiplier=0.15, residual_multiplier=0.6,
                     logits_scaling=2.5)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2, tie_word_embeddings=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=16,
                     sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 150_000.0,
                                      "truncate": False})),
}


def missing_config_class(family: str) -> str | None:
    """Why this transformers cannot build the family (None: it can)."""
    import transformers
    cls, arch, _ = FAMILIES[family]
    if not hasattr(transformers, cls) or not hasattr(transformers, arch):
        return f"transformers {transformers.__version__} has no {cls}/{arch}"
    return None


def make_family_checkpoint(family: str, out_dir: Path, *, seed: int = 0, overrides: dict | None = None) -> Path:
    """Writes the tiny checkpoint of `family` (with `overrides` on its config) into out_dir."""
    import torch
    import transformers
    from tests.conftest import load_script

    maker = load_script("make_tiny_checkpoint")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_vocab = maker._write_tokenizer(out)
    vocab = -(-tok_vocab // maker.VOCAB_MULTIPLE) * maker.VOCAB_MULTIPLE
    cls, arch, extra = FAMILIES[family]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=maker.BOS_ID, eos_token_id=maker.EOS_ID, pad_token_id=maker.PAD_ID)
    kwargs.update(extra)
    kwargs.update(overrides or {})
    config = getattr(transformers, cls)(**kwargs)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    maker._reinit_(model, seed, maker.WEIGHT_STD)
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=maker.BOS_ID, eos_token_id=maker.EOS_ID,
                                  pad_token_id=maker.PAD_ID).save_pretrained(out)
    return out


def config_of(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())
