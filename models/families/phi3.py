"""Phi-3: the Llama layout stored fused: `self_attn.qkv_proj` (our layout as is) and `mlp.gate_up_proj` (gate
rows, then up; split at load into our gate_proj and up_proj). LongRoPE (`longrope`, older `su`) scaling and
partial rotary (Phi-4-mini) in models/rope.py; `sliding_window` applies to every layer, as in transformers."""
from __future__ import annotations

from typing import Any, Callable

import torch

from models.families import base


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    fields = base.parse(raw, arch, source)
    fields.update(base.sliding_fields({**raw, "layer_types": None}, source, fields["num_layers"],
                                      fields["max_position_embeddings"]))
    return fields


def checkpoint_tensor(name: str, shape: tuple[int, ...], read: Callable[[str], torch.Tensor],
                      cfg: Any) -> torch.Tensor | None:
    if name.endswith("self_attn.qkv_proj.weight"):
        return read(name)
    for part, half in (("mlp.gate_proj.weight", 0), ("mlp.up_proj.weight", 1)):
        if name.endswith(part):
            fused = read(name.removesuffix(part) + "mlp.gate_up_proj.weight")  # [2I, H]
            return fused.chunk(2, dim=0)[half]
    return None
