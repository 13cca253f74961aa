"""Granite: the Llama layout with four multipliers: embeddings (embedding_multiplier), the attention scale
(attention_multiplier replaces head_dim ** -0.5), each sublayer's output before its residual add
(residual_multiplier), and the logits divided by logits_scaling."""
from __future__ import annotations

from typing import Any

from models.families import base


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    fields = base.parse(raw, arch, source)
    fields.update(embed_scale=float(raw.get("embedding_multiplier", 1.0)),
                  attn_scale=float(raw.get("attention_multiplier", fields["head_dim"] ** -0.5)),
                  residual_scale=float(raw.get("residual_multiplier", 1.0)),
                  logits_divisor=float(raw.get("logits_scaling", 1.0)))
    return fields
