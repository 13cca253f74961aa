"""Pre-quantized checkpoints made at test time: known integer weights packed as AutoAWQ, AutoGPTQ and
compressed-tensors pack them (written here from their packers' loops, independently of the unpacking code
under test), and a stand-in for the block kernels' BlockWeight."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from models.quant.block_formats import BlockFormat, dequantize_reference

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


class StandInBlockWeight:
    """BlockWeight(parts, in_features, bias) as models/quant/blocks.py declares it, computing x @ W.T + b with the
    reference dequantizer (what the block kernels must agree with)."""

    def __init__(self, parts: list[tuple[BlockFormat, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None) -> None:
        self.parts, self.in_features, self.bias = parts, in_features, bias
        self.weight = torch.cat([torch.from_numpy(dequantize_reference(b.numpy(), f, in_features))
                                 for f, b in parts])  # [out, in] float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        out = x.float() @ self.weight.T
        return (out if self.bias is None else out + self.bias.float()).to(x.dtype)


@dataclass
class Known:
    """One layer's known integer weights: w = scales[o, i // group] * (codes[o, i] - zeros[o, i // group])."""

    codes: np.ndarray  # int64 [out, in], unsigned codes
    scales: np.ndarray  # float16 [out, groups]
    zeros: np.ndarray  # int64 [out, groups]
    group: int

    def dequantized(self) -> torch.Tensor:
        s = np.repeat(self.scales.astype(np.float32), self.group, axis=1)
        z = np.repeat(self.zeros, self.group, axis=1)
        return torch.from_numpy(s * (self.codes - z).astype(np.float32))


def known_weights(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> Known:
    """w [out, in] rounded onto a grid of `bits` per group (the codes a quantizer would pick; any codes would do)."""
    out, cols = w.shape
    g = w.float().reshape(out, cols // group, group).numpy()
    levels = (1 << bits) - 1
    if symmetric:
        mid = 1 << (bits - 1)
        scales = (np.abs(g).max(axis=2) / (mid - 1)).astype(np.float16)
        zeros = np.full(scales.shape, mid, dtype=np.int64)
    else:
        lo, hi = g.min(axis=2), g.max(axis=2)
        scales = ((hi - lo) / levels).astype(np.float16)
        # (from 1: GPTQ's v1 format cannot store a zero of 0, whose "- 1" wraps)
        zeros = np.clip(np.round(-lo / scales.astype(np.float32)), 1, levels).astype(np.int64)
    s = scales.astype(np.float32)[..., None]
    codes = np.clip(np.round(g / s) + zeros[..., None], 0, levels).astype(np.int64).reshape(out, cols)
    return Known(codes, scales, zeros, group)


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """uint values [..., n] -> int32 [..., n * bits / 32]: consecutive values, the first in the lowest bits."""
    per = 32 // bits
    v = values.astype(np.uint64).reshape(*values.shape[:-1], -1, per)
    word = np.zeros(v.shape[:-1], dtype=np.uint64)
    for i in range(per):
        word |= v[..., i] << np.uint64(bits * i)
    return word.astype(np.uint32).view(np.int32)


def pack_awq(k: Known) -> dict[str, torch.Tensor]:
    """AutoAWQ's WQLinear_GEMM.from_linear: qweight [in, out / 8] with outputs in AWQ_ORDER per word."""
    def pack(t: np.ndarray) -> np.ndarray:  # [r, out] -> [r, out / 8]
        packed = np.zeros((t.shape[0], t.shape[1] // 8), dtype=np.uint32)
        for col in range(t.shape[1] // 8):
            for i in range(8):
                packed[:, col] |= t[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << np.uint32(4 * i)
        return packed.view(np.int32)
    return {"qweight": torch.from_numpy(pack(k.codes.T)), "qzeros": torch.from_numpy(pack(k.zeros.T)),
            "scales": torch.from_numpy(k.scales.T.copy())}


def pack_gptq(k: Known, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack: qweight [in * bits / 32, out] packing consecutive inputs; qzeros
    [groups, out * bits / 32] packing consecutive outputs, storing zero - 1 in the v1 format; g_idx i // group."""
    stored = k.zeros - 1 if v1 else k.zeros
    cols = k.codes.shape[1]
    return {"qweight": torch.from_numpy(_words(k.codes, bits).T.copy()),
            "qzeros": torch.from_numpy(_words(stored.T, bits)), "scales": torch.from_numpy(k.scales.T.copy()),
            "g_idx": torch.arange(cols, dtype=torch.int32) // k.group}


def pack_compressed(k: Known, bits: int, packed: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors: signed q = u - 2^(bits-1); pack-quantized packs q + 8 into weight_packed [out, in / 8]
    (pack_to_int32), int-quantized stores q as int8; weight_scale [out, groups]; weight_zero_point signed."""
    mid = 1 << (bits - 1)
    out, cols = k.codes.shape
    tensors = {"weight_scale": torch.from_numpy(k.scales.copy()),
               "weight_shape": torch.tensor([out, cols], dtype=torch.int64)}
    if packed:
        tensors["weight_packed"] = torch.from_numpy(_words(k.codes, bits))
    else:
        tensors["weight"] = torch.from_numpy((k.codes - mid).astype(np.int8))
    if not (k.zeros == mid).all():
        tensors["weight_zero_point"] = torch.from_numpy((k.zeros - mid).astype(np.int8))
    return tensors


def write_prequantized(src: Path, dst: Path, quantization_config: dict, pack, bits: int, group: int | None,
                       symmetric: bool) -> dict[str, torch.Tensor]:
    """src's checkpoint with every decoder linear layer replaced by `pack(Known)`'s tensors and config.json's
    quantization_config set (group None: one per output row); returns the known dequantized weight of each
    layer (by checkpoint name)."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    known: dict[str, torch.Tensor] = {}
    for name in list(state):
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and layer.endswith(LINEARS):
            w = state.pop(name)
            k = known_weights(w, bits, group or w.shape[1], symmetric)
            known[name] = k.dequantized()
            state.update({f"{layer}.{part}": t.contiguous() for part, t in pack(k).items()})
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return known
