"""Float weights -> llama.cpp block bytes (models/quant/block_formats.py), in torch, vectorized over all blocks.

Each quantizer is ggml's reference one (ggml-quants.c `quantize_row_*_ref`), step for step in float32, so the
bytes equal those of the `gguf` package's numpy port (gguf.quants.quantize: the tests compare them byte for
byte). Measured on a [8192, 2048] float32 matrix, 2 threads: 0.04-0.1 s per format (the numpy port:
0.09-0.15 s), so a 1.7B model quantizes in a few seconds. Per block of 32 weights:

- Q8_0: d = absmax / 127, q = round-half-away(w / d) in [-127, 127]; bytes: d (fp16), 32 x int8.
- Q4_0: d = -(the value of largest magnitude) / 8, q = trunc(w / d + 8.5) in [0, 15]; bytes: d (fp16),
  16 bytes of nibbles (weight i in the low nibble of byte i, weight 16 + i in its high nibble).
- Q4_1: d = (max - min) / 15, m = min, q = trunc((w - m) / d + 0.5) in [0, 15]; bytes: d, m (fp16), nibbles.
- Q5_0 / Q5_1: as Q4_0 / Q4_1 with 5 bits (d = -max / 16, + 16.5; d = (max - min) / 31); bit 4 of each q
  goes into a 32-bit little-endian word (bit i for weight i) after d (and m), the low nibbles as above.

The scale is computed and applied in float32 and only stored as float16, as ggml does (so a stored d rounds
once). The K-quants (Q4_K, Q5_K, Q6_K) are not made here: ggml's quantizers for them search per sub-block
and have no port to compare with; GGUF files bring them already quantized.
"""
from __future__ import annotations

import torch

from models.quant.block_formats import FORMATS, BlockFormat

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
BLOCK = 32  # weights per block of every format above
CHUNK = 1 << 19  # weights quantized per slice


def quantize_blocks(weight: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """weight [rows, columns] (any float dtype, columns % 32 == 0) -> uint8 [rows, fmt.row_bytes(columns)],
    on weight's device. Raises ValueError for a format without a quantizer here or a width not a multiple
    of 32."""
    if fmt.name not in QUANTIZABLE:
        raise ValueError(f"no quantizer for {fmt.name} here; choose one of {', '.join(QUANTIZABLE)}")
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"{fmt.name} quantizes [rows, columns] with columns a multiple of {BLOCK}, "
                         f"not {tuple(weight.shape)}")
    rows, columns = weight.shape
    out = torch.empty(rows, fmt.row_bytes(columns), dtype=torch.uint8, device=weight.device)
    # In slices of ~CHUNK weights: the float32 temporaries stay in cache (measured 3-5x faster than whole
    # [8192, 2048] matrices) and a few MB whatever the matrix.
    step = max(1, CHUNK // columns)
    for start in range(0, rows, step):
        blocks = weight[start:start + step].detach().to(torch.float32).reshape(-1, BLOCK)  # [n, 32]
        out[start:start + step] = _QUANTIZERS[fmt.name](blocks).reshape(-1, out.shape[1])
    return out


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """v float32 [n, 1] -> its float16 (round to nearest even, as numpy's astype) as uint8 [n, 2], little-endian."""
    return v.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d in float32 (correctly rounded division, not an approximate reciprocal), 0 where d == 0."""
    return torch.where(d == 0, torch.zeros_like(d), torch.div(torch.ones_like(d), d))


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [n, 32] -> [n, 16]: the low 4 bits of q[i] | the low 4 bits of q[16 + i] << 4."""
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [n, 32] (5-bit values) -> [n, 4]: bit 4 of q[i] as bit i of a little-endian uint32."""
    bits = ((q >> 4) & 1).to(torch.int64).reshape(-1, 4, 8)  # [n, byte, bit]
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int64, device=q.device)
    return (bits * weights).sum(dim=-1).to(torch.uint8)


def _symmetric(blocks: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 / Q5_0 (levels 16 / 32): d = -(the first value of largest magnitude) / (levels / 2) and
    q = trunc(w / d + levels / 2 + 0.5) clipped to [0, levels - 1], as ggml; returns d [n, 1], q uint8 [n, 32]."""
    half = levels // 2
    top = torch.gather(blocks, 1, blocks.abs().argmax(dim=1, keepdim=True))  # [n, 1], signed
    d = top / -half
    q = torch.trunc(blocks * _inverse(d) + (half + 0.5)).clamp_(0, levels - 1).to(torch.uint8)
    return d, q


def _affine(blocks: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 / Q5_1: d = (max - min) / (levels - 1), q = trunc((w - min) / d + 0.5); returns d, min [n, 1], q."""
    lo, hi = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
    d = (hi - lo) / (levels - 1)
    q = torch.trunc((blocks - lo) * _inverse(d) + 0.5).clamp_(0, levels - 1).to(torch.uint8)
    return d, lo, q


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(dim=1, keepdim=True) / 127  # [n, 1]
    scaled = blocks * _inverse(d)
    # ggml's roundf: half away from zero (torch.round is half to even), in gguf's exact form
    a = scaled.abs()
    whole = a.floor()
    q = torch.copysign(whole + torch.floor(2 * (a - whole)), scaled).to(torch.int8)
    return torch.cat([_fp16_bytes(d), q.view(torch.uint8)], dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(blocks, 16)
    return torch.cat([_fp16_bytes(d), _nibbles(q)], dim=1)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, q = _affine(blocks, 16)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(m), _nibbles(q)], dim=1)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(blocks, 32)
    return torch.cat([_fp16_bytes(d), _high_bits(q), _nibbles(q)], dim=1)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, q = _affine(blocks, 32)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(m), _high_bits(q), _nibbles(q)], dim=1)


_QUANTIZERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1}
assert set(_QUANTIZERS) == set(QUANTIZABLE) and set(QUANTIZABLE) <= set(FORMATS)
