"""OLMo 2: norms after attention and after the MLP, none before (post_attention_layernorm,
post_feedforward_layernorm), and q/k RMSNorms over the whole q and k projections (not per head)."""
from __future__ import annotations

from typing import Any

from models.families import base


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    base.refuse(raw, source, "clip_qkv", (), "OLMo 1's q/k/v clipping")
    fields = base.parse(raw, arch, source)
    fields.update(layout="post", qk_norm=True, qk_norm_whole=True)
    return fields
