"""MXFP4 (the OCP microscaling format GPT-OSS checkpoints store their experts in), dequantized at load.

Each group of 32 values along a row shares one 8-bit power-of-two scale (E8M0: 2 ** (byte - 127)); each value
is a 4-bit E2M1 float, two per byte, the low nibble first. Tensors: blocks uint8 [..., groups, 16] and
scales uint8 [..., groups]; the values come out as [..., groups * 32], in float32 (the loader casts them to
the model's dtype). As transformers' `convert_moe_packed_tensors`, without its final transpose.
"""
from __future__ import annotations

import torch

from tandem.errors import CheckpointError

# E2M1 code -> value: sign bit 3, exponent bits 2-1, mantissa bit 0.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks: uint8 [..., G, 16]; scales: uint8 [..., G] -> float32 [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise CheckpointError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                              f"{scales.dtype}: expected uint8 [..., G, 16] and uint8 [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: low nibble, high nibble, next byte...
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float())
    return values.flatten(-2)  # [..., G * 32]


def quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse (for tests and tools): float [..., G * 32] -> (blocks uint8 [..., G, 16], scales uint8
    [..., G]), each value rounded to the nearest E2M1 value of its group's power-of-two scale."""
    groups = values.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    amax = groups.abs().amax(dim=-1).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # 6 = E2M1's largest value
    scaled = groups / torch.exp2(exp)[..., None]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(dim=-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)
