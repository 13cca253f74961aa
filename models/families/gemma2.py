"""Gemma 2: sandwich norms (input, post-attention, pre- and post-feed-forward), RMSNorm times (1 + weight),
embeddings times sqrt(hidden), attention scaled by query_pre_attn_scalar ** -0.5 with its scores soft-capped
(attn_logit_softcapping), final logits soft-capped (final_logit_softcapping), sliding and global layers
alternating (layer_types; default: even layers slide), GeGLU with tanh GELU (hidden_activation)."""
from __future__ import annotations

import math
from typing import Any

from models.families import base


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    fields = base.parse({**raw, "hidden_act": raw.get("hidden_activation") or raw.get("hidden_act")
                         or "gelu_pytorch_tanh"}, arch, source)
    layers = fields["num_layers"]
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    fields.update(base.sliding_fields({**raw, "layer_types": types}, source, layers,
                                      fields["max_position_embeddings"]))
    scalar = raw.get("query_pre_attn_scalar") or fields["head_dim"]
    fields.update(
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        layout="sandwich", norm_offset=True, embed_scale=math.sqrt(fields["hidden_size"]),
        attn_scale=float(scalar) ** -0.5,
        attn_softcap=_cap(raw.get("attn_logit_softcapping")), final_softcap=_cap(raw.get("final_logit_softcapping")),
    )
    return fields


def _cap(value: Any) -> float | None:
    return None if value is None else float(value)
