"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a window-attention ViT and patch merger
(models/vision/qwen2_5_vl.py) in front of Qwen2's text tower, whose rope is M-RoPE: each position is a triple
(temporal, height, width), text tokens have three equal ones, an image's tokens their row and column on its merged
grid (executor_service/vision/mrope.py), and `mrope_section` says which rotary frequencies turn by which of the
three. The text fields sit in `text_config` (what transformers 5 writes) or at the top level (the Hub's
checkpoints); either way the checkpoint names are the text tower's `model.` / `lm_head.` and the tower's `visual.`
(transformers writes that layout too)."""
from __future__ import annotations

from typing import Any

from models.families import base
from models.vision.config import VisionConfig
from tandem.errors import CheckpointError

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    text = dict(raw.get("text_config") or {k: v for k, v in raw.items() if k != "vision_config"})
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = tuple(int(s) for s in rope.pop("mrope_section", None) or ())
    if rope.get("rope_type", rope.get("type")) == "mrope":  # (older configs' name of the default rope + M-RoPE)
        rope.pop("type", None)
        rope["rope_type"] = "default"
    text["rope_parameters"], text["rope_scaling"] = rope, None
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    fields = base.parse(text, "Qwen2ForCausalLM", source)
    half = int(fields["head_dim"]) // 2
    if len(section) != 3 or sum(section) != half:
        raise CheckpointError(f"{source}: rope mrope_section {list(section)} must be 3 numbers summing to head_dim / 2 "
                              f"= {half} (the rotary frequencies turned by temporal, height and width positions)")
    fields.update(checkpoint_architecture=arch, mrope_section=section,
                  vision=_vision(raw, int(fields["hidden_size"]), source))
    return fields


def _vision(raw: dict[str, Any], text_hidden: int, source: str) -> VisionConfig:
    v = dict(raw.get("vision_config") or {})
    base.refuse(v, source, "hidden_act", ("silu",), "the vision blocks' MLP runs SiLU")
    patch, merge = int(v.get("patch_size", 14)), int(v.get("spatial_merge_size", 2))
    window, hidden, heads = int(v.get("window_size", 112)), int(v.get("hidden_size", 3584)), int(v.get("num_heads", 16))
    if window < patch * merge or hidden % heads or (hidden // heads) % 4:
        raise CheckpointError(f"{source}: vision_config.window_size {window} must be at least patch_size x "
                              f"spatial_merge_size ({patch * merge}), and hidden_size {hidden} / num_heads {heads} a "
                              "multiple of 4 (the axial rope's two halves)")
    out = int(v.get("out_hidden_size", text_hidden))
    if out != text_hidden:
        raise CheckpointError(f"{source}: vision_config.out_hidden_size {out} is not the text hidden_size "
                              f"{text_hidden}")
    depth = int(v.get("depth", 32))
    full = tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31)))
    if any(not 0 <= i < depth for i in full):
        raise CheckpointError(f"{source}: vision_config.fullatt_block_indexes {list(full)} name blocks outside "
                              f"0..{depth - 1}")
    return VisionConfig(
        family="qwen2_5_vl", hidden_size=hidden, intermediate_size=int(v.get("intermediate_size", 3420)),
        num_layers=depth, num_heads=heads, num_channels=int(v.get("in_channels", 3)), image_size=patch * merge,
        patch_size=patch, layer_norm_eps=1e-6, hidden_act="silu", scale_factor=merge,
        image_token_id=int(base.need(raw, "image_token_id", source)), text_hidden_size=text_hidden,
        temporal_patch_size=int(v.get("temporal_patch_size", 2)), window_size=window, fullatt_blocks=full,
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
