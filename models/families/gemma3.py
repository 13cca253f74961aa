"""Gemma 3 (text): Gemma 2's layer (sandwich norms, (1 + weight) RMSNorm, scaled embeddings, GeGLU) plus
per-head q/k norms, five sliding layers to one global (layer_types, else sliding_window_pattern, default 6),
each kind with its own rotary settings: rope_parameters keyed by layer type (transformers 5), or rope_theta
+ rope_scaling for the global layers and rope_local_base_freq for the sliding ones (older configs). Soft-capping
only where the config sets it (usually not)."""
from __future__ import annotations

from typing import Any

from models.families import base, gemma2
from tandem.errors import CheckpointError


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    if raw.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: use_bidirectional_attention is not supported (Tandem serves "
                              "causal decoders)")
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    layers = int(base.need(raw, "num_hidden_layers", source))
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    global_rope, local_rope = _ropes(raw)
    flat = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
    fields = gemma2.parse({**flat, "layer_types": types}, arch, source)
    fields.update(qk_norm=True, rope=global_rope, local_rope=local_rope)
    return fields


def _ropes(raw: dict[str, Any]):
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        return (base.rope_from_hf(raw, params.get("full_attention") or {"rope_theta": 1_000_000.0}),
                base.rope_from_hf(raw, params.get("sliding_attention") or {"rope_theta": 10_000.0}))
    scaling = dict(raw.get("rope_scaling") or params or {})
    scaling.setdefault("rope_theta", raw.get("rope_theta") or 1_000_000.0)
    return (base.rope_from_hf(raw, scaling),
            base.rope_from_hf(raw, {"rope_theta": raw.get("rope_local_base_freq") or 10_000.0}))
