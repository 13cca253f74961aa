"""Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`): a SigLIP-style
vision encoder and a pixel-shuffle connector (models/vision/idefics3.py) in front of a Llama text tower. The text
tower is the Llama layout read from `text_config`; its checkpoint names sit under `model.text_model.` (the
loader maps ours there: CHECKPOINT_TEXT_PREFIX), the vision tower's under `model.vision_model.` and
`model.connector.`."""
from __future__ import annotations

from typing import Any

from models.families import base
from models.vision.config import VisionConfig
from tandem.errors import CheckpointError

ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
TEXT_PREFIX = "model.text_model."


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    text = dict(base.need(raw, "text_config", source))
    if text.get("model_type", "llama") != "llama":
        raise CheckpointError(f"{source}: text_config.model_type={text.get('model_type')!r} is not supported "
                              f"for {arch} (Tandem serves its Llama text tower)")
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    fields = base.parse(text, "LlamaForCausalLM", source)
    fields.update(checkpoint_architecture=arch, checkpoint_text_prefix=TEXT_PREFIX,
                  vision=_vision(raw, int(fields["hidden_size"]), source))
    return fields


def _vision(raw: dict[str, Any], text_hidden: int, source: str) -> VisionConfig:
    v = dict(raw.get("vision_config") or {})
    base.refuse(v, source, "hidden_act", ("gelu_pytorch_tanh", "gelu_tanh"),
                "the vision encoder's MLP runs the tanh GELU")
    image_size, patch = int(v.get("image_size", 224)), int(v.get("patch_size", 32))
    scale = int(raw.get("scale_factor", 2))
    side = image_size // patch
    if image_size % patch or side % scale:
        raise CheckpointError(f"{source}: vision_config.image_size {image_size} must be a multiple of patch_size "
                              f"{patch}, and the patches per side a multiple of scale_factor {scale}")
    return VisionConfig(
        family="idefics3", hidden_size=int(v.get("hidden_size", 1152)),
        intermediate_size=int(v.get("intermediate_size", 3072)), num_layers=int(v.get("num_hidden_layers", 12)),
        num_heads=int(v.get("num_attention_heads", 16)), num_channels=int(v.get("num_channels", 3)),
        image_size=image_size, patch_size=patch, layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        hidden_act="gelu_tanh", scale_factor=scale, image_token_id=int(base.need(raw, "image_token_id", source)),
        text_hidden_size=text_hidden)
