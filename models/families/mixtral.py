"""Mixtral: Mistral's attention (sliding window when set) with a sparse MoE MLP on every layer: router softmax,
top-k, the k probabilities renormalised (models/moe.py, Qwen3-MoE's dispatch with norm_topk_prob). The
checkpoint names experts `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down) and the router
`block_sparse_moe.gate`."""
from __future__ import annotations

from typing import Any, Callable

import torch

from models.families import base, mistral


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    fields = mistral.parse(raw, arch, source)
    fields.update(base.moe_fields(raw, source, "num_local_experts", "intermediate_size"), norm_topk_prob=True)
    return fields


def checkpoint_tensor(name: str, shape: tuple[int, ...], read: Callable[[str], torch.Tensor],
                      cfg: Any) -> torch.Tensor | None:
    prefix, sep, rest = name.partition(".mlp.")
    if not sep:
        return None
    moe = f"{prefix}.block_sparse_moe."
    if rest == "gate.weight":
        return read(moe + "gate.weight")
    experts = range(shape[0]) if rest.startswith("experts_") else ()
    if rest == "experts_gate_up":  # [E, 2I, H]: w1 (gate) rows, then w3 (up)
        return torch.stack([torch.cat([read(f"{moe}experts.{e}.w1.weight"), read(f"{moe}experts.{e}.w3.weight")])
                            for e in experts])
    if rest == "experts_down":  # [E, H, I]
        return torch.stack([read(f"{moe}experts.{e}.w2.weight") for e in experts])
    return None
