"""Mistral: the Llama layout with sliding-window attention on every layer (`sliding_window`; null or a window
covering max_position_embeddings = full attention). transformers ignores `layer_types` for Mistral (every
layer slides), and so does this."""
from __future__ import annotations

from typing import Any

from models.families import base


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    fields = base.parse(raw, arch, source)
    fields.update(base.sliding_fields({**raw, "layer_types": None}, source, fields["num_layers"],
                                      fields["max_position_embeddings"]))
    return fields
