"""SmolLM3: the Llama layout where some layers apply no rotary embedding (NoPE): no_rope_layers[i] is 1 for a
layer that rotates, 0 for one that does not; absent, every no_rope_layer_interval-th layer (default 4) skips
it. Its sliding-window option (use_sliding_window) is refused, as for Qwen2."""
from __future__ import annotations

from typing import Any

from models.families import base
from tandem.errors import CheckpointError


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    fields = base.parse(raw, arch, source)
    layers = fields["num_layers"]
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise CheckpointError(f"{source}: no_rope_layers lists {len(flags)} layers, num_hidden_layers is {layers}")
    fields.update(rope_layers=tuple(bool(f) for f in flags))
    return fields
