"""GPT-OSS: attention with learned sinks (`self_attn.sinks`, one logit per head joining every softmax), q/k/v/o
biases, sliding and full layers alternating (layer_types), YaRN rope; a MoE MLP on every layer whose router
has a bias and takes the softmax of the top-k logits, whose experts have biases and the clamped SwiGLU
(models/moe.py).

Checkpoint layout: the router is `mlp.router`; experts are 3-D, `mlp.experts.gate_up_proj` [E, H, 2I] with
gate and up interleaved along the last axis (even columns gate, odd up) and `down_proj` [E, I, H], each
multiplied as x @ W, with `*_bias` [E, 2I] / [E, H]. Released checkpoints store the two expert weights as
MXFP4 (`*_blocks` + `*_scales`, quantization_config.quant_method "mxfp4"): dequantized at load
(models/quant/mxfp4.py) into our layout, experts_gate_up [E, 2I, H] (gate rows first) and experts_down [E, H, I]."""
from __future__ import annotations

from typing import Any, Callable

import torch

from models.families import base
from models.quant.mxfp4 import dequantize_mxfp4
from tandem.errors import CheckpointError


def parse(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    quant = raw.get("quantization_config")
    method = (quant or {}).get("quant_method") if isinstance(quant, dict) else quant
    if quant is not None and method != "mxfp4":
        raise CheckpointError(f"{source}: quantization_config.quant_method={method!r} is not supported "
                              "(GPT-OSS checkpoints load from float or mxfp4 experts)")
    fields = base.parse({k: v for k, v in raw.items() if k != "quantization_config"}, arch, source)
    layers = fields["num_layers"]
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(layers)]
    fields.update(base.sliding_fields({**raw, "layer_types": types}, source, layers,
                                      fields["max_position_embeddings"]))
    fields.update(base.moe_fields(raw, source, "num_local_experts", "intermediate_size"))
    fields.update(moe_style="gpt_oss", swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
                  swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)), attention_sinks=True,
                  o_bias=fields["attention_bias"], quantized_experts="mxfp4" if quant is not None else "")
    return fields


def checkpoint_tensor(name: str, shape: tuple[int, ...], read: Callable[[str], torch.Tensor],
                      cfg: Any) -> torch.Tensor | None:
    prefix, sep, rest = name.partition(".mlp.")
    if not sep:
        return None
    mlp = f"{prefix}.mlp."
    if rest in ("gate.weight", "gate.bias"):
        return read(mlp + "router." + rest.removeprefix("gate."))
    if rest == "experts_gate_up":  # -> [E, 2I, H], gate rows then up rows
        w = _expert_weight(mlp + "experts.gate_up_proj", read, cfg)  # [E, 2I, H], interleaved rows
        return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
    if rest == "experts_gate_up_bias":  # [E, 2I] interleaved -> gate then up
        b = read(mlp + "experts.gate_up_proj_bias")
        return torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
    if rest == "experts_down":  # -> [E, H, I]
        return _expert_weight(mlp + "experts.down_proj", read, cfg)
    if rest == "experts_down_bias":
        return read(mlp + "experts.down_proj_bias")
    return None


def _expert_weight(name: str, read: Callable[[str], torch.Tensor], cfg: Any) -> torch.Tensor:
    """The expert weight `name` as [E, out, in] (the transpose of the checkpoint's x @ W layout)."""
    if cfg.quantized_experts == "mxfp4":  # blocks [E, out, in/32, 16] + scales [E, out, in/32]: already [out, in]
        return dequantize_mxfp4(read(name + "_blocks"), read(name + "_scales"))
    return read(name).transpose(1, 2)
