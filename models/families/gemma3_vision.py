"""Gemma 3 with images (`Gemma3ForConditionalGeneration`, Gemma 3 4B and up): a SigLIP vision encoder and
Gemma3MultiModalProjector (models/vision/gemma3.py) in front of the Gemma 3 text tower (models/families/gemma3.py)
read from `text_config`, whose checkpoint names sit under `language_model.model.` (released checkpoints and
transformers 5's save_pretrained alike). The tokens of one image attend to each other both ways during prefill
(VisionConfig.bidirectional_images). transformers' Gemma3ForConditionalGeneration applies no final logit
soft-capping (its Gemma3ForCausalLM does): neither do we, whatever text_config says."""
from __future__ import annotations

from typing import Any

from models.families import base, gemma3
from models.vision.config import VisionConfig
from tandem.errors import CheckpointError

ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
TEXT_PREFIX = "language_model.model."
# Gemma3TextConfig's defaults (transformers 5.24): released config.json files leave most of them out
TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                     rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, bos_token_id=2,
                     eos_token_id=1, tie_word_embeddings=True)


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    text = {**TEXT_DEFAULTS, **(base.need(raw, "text_config", source))}
    for key in ("torch_dtype", "dtype", "bos_token_id", "eos_token_id"):  # released files set these at the top
        if raw.get(key) is not None and key not in raw["text_config"]:
            text[key] = raw[key]
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise CheckpointError(f"{source}: text_config.model_type={text.get('model_type')!r} is not supported for "
                              f"{arch} (Tandem serves its Gemma 3 text tower)")
    if not raw.get("tie_word_embeddings", text["tie_word_embeddings"]):
        raise CheckpointError(f"{source}: tie_word_embeddings false is not supported for {arch} (the LM head is "
                              "the embedding table)")
    fields = gemma3.parse(text, "Gemma3ForCausalLM", source)
    vision = _vision(raw, int(fields["hidden_size"]), source)
    if not 0 <= vision.image_token_id < fields["vocab_size"]:
        raise CheckpointError(f"{source}: image_token_index {vision.image_token_id} is not in the vocabulary "
                              f"({fields['vocab_size']} tokens)")
    fields.update(checkpoint_architecture=arch, checkpoint_text_prefix=TEXT_PREFIX, final_softcap=None,
                  tie_word_embeddings=True, vision=vision)
    return fields


def _vision(raw: dict[str, Any], text_hidden: int, source: str) -> VisionConfig:
    v = dict(raw.get("vision_config") or {})
    if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise CheckpointError(f"{source}: vision_config.model_type={v.get('model_type')!r} is not supported "
                              "(Gemma 3's SigLIP encoder)")
    base.refuse(v, source, "hidden_act", ("gelu_pytorch_tanh", "gelu_tanh"),
                "the vision encoder's MLP runs the tanh GELU")
    image_size, patch = int(v.get("image_size", 224)), int(v.get("patch_size", 16))
    tokens = int(raw.get("mm_tokens_per_image", 256))
    side, per_side = image_size // patch, int(round(tokens ** 0.5))
    if image_size % patch or per_side * per_side != tokens or side % per_side:
        raise CheckpointError(f"{source}: vision_config.image_size {image_size} must be a multiple of patch_size "
                              f"{patch}, and mm_tokens_per_image {tokens} a square whose side divides the "
                              f"{side} patches per side (the projector's average pooling)")
    return VisionConfig(
        family="gemma3", hidden_size=int(v.get("hidden_size", 768)),
        intermediate_size=int(v.get("intermediate_size", 3072)), num_layers=int(v.get("num_hidden_layers", 12)),
        num_heads=int(v.get("num_attention_heads", 12)), num_channels=int(v.get("num_channels", 3)),
        image_size=image_size, patch_size=patch, layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        hidden_act="gelu_tanh", scale_factor=side // per_side,
        image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 262_144))),
        text_hidden_size=text_hidden, bidirectional_images=True)
