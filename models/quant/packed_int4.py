"""The packed integer weights of AWQ, GPTQ and compressed-tensors checkpoints, unpacked exactly as each library
does, and their mapping onto llama.cpp blocks (models/quant/block_formats.py).

Every scheme stores w = scale * (q - zero) for groups of `group` consecutive inputs of each output row; they
differ in how q and zero are packed into int32 words:

- AutoAWQ "gemm": qweight int32 [in, out / 8], 8 outputs per word in the order [0, 2, 4, 6, 1, 3, 5, 7]
  (nibble i holds output 8c + ORDER[i]); qzeros int32 [in / group, out / 8] packed the same; scales [in / group,
  out]. q, zero in 0..15.
- GPTQ (AutoGPTQ, gptqmodel, optimum): qweight int32 [in * bits / 32, out], 32 / bits consecutive inputs per word,
  the first in the lowest bits; qzeros int32 [in / group, out * bits / 32] packed along outputs the same way;
  scales [in / group, out]; g_idx [in] (the group of each input). The original format ("gptq", v1) stores
  zero - 1, gptqmodel's "gptq_v2" the zero itself.
- compressed-tensors: "pack-quantized" weight_packed int32 [out, in / 8], 8 consecutive inputs per word, the first
  in the low nibble, as q + 8 for the signed q in -8..7; "int-quantized" / "naive-quantized" weight int8 [out,
  in] holding the signed q; weight_scale [out, in / group] (channel: [out, 1]); weight_zero_point (asymmetric
  only) signed, [out, groups], or packed like the weights along outputs ([ceil(out / 8), groups] int32).

All of them become Unpacked: unsigned codes u = q (+ 2^(bits-1) for the signed ones) and zeros likewise, so that
w = scale * (u - zero). To blocks (group a multiple of 32, each block's scale the group's, as float16):
- 4 bits, symmetric (zero = 8): Q4_0, d = scale, the codes as they are: exact up to float16 rounding of d;
- 4 bits with zero points: Q4_1, d = scale, m = -scale * zero (float16, rounded once from float32);
- 8 bits, symmetric (zero = 128): Q8_0, d = scale, q = u - 128 (which may be -128: ggml's own quantizer stops
  at -127, the block arithmetic does not care).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.quant.block_formats import FORMATS, BlockFormat
from models.quant.block_quantize import BLOCK
from tandem.errors import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's gemm packing: nibble i of a word holds output 8c + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8c + t is nibble AWQ_REVERSE_ORDER[t]


@dataclass
class Unpacked:
    """One linear layer's integer weights: w[o, i] = scales[o, i // group] * (codes[o, i] - zero), where zero is
    zeros[o, i // group], or 2^(bits-1) when zeros is None (symmetric)."""

    codes: torch.Tensor  # uint8 [out, in], 0 .. 2^bits - 1
    scales: torch.Tensor  # float [out, in / group]
    zeros: torch.Tensor | None  # int16 [out, in / group] (v1 GPTQ's zero + 1 may reach 16), or None
    bits: int
    group: int

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weights the checkpoint means (the tests' oracle)."""
        zero = (torch.full_like(self.scales, 1 << (self.bits - 1)) if self.zeros is None else self.zeros.float())
        per_input = lambda t: t.float().repeat_interleave(self.group, dim=1)  # noqa: E731  [out, in]
        return per_input(self.scales) * (self.codes.float() - per_input(zero))


def _words_to_values(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., n * 32 / bits]: each word's values from its lowest bits up."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)  # [per]
    values = (words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # [..., n, per]
    return values.reshape(*words.shape[:-1], words.shape[-1] * per).to(torch.uint8)


def _check(what: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
        raise CheckpointError(f"{what} is {tuple(tensor.shape)} {tensor.dtype}; expected {shape}"
                              f"{'' if dtype is None else ' ' + str(dtype)}")


def check_plain_groups(what: str, g_idx: torch.Tensor, in_features: int, group: int) -> None:
    """Raises CheckpointError unless g_idx [in] (the group of each input) is i // group: act-order checkpoints
    (GPTQ desc_act, compressed-tensors actorder) reorder them, and a block of 32 consecutive inputs would then
    mix groups."""
    plain = torch.arange(in_features, device=g_idx.device) // group
    if g_idx.shape != plain.shape or not torch.equal(g_idx.to(torch.int64), plain):
        raise CheckpointError(f"{what} reorders the inputs' groups (act-order): a block of 32 consecutive inputs "
                              "would mix groups; such checkpoints do not map to blocks")


def unpack_awq(name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
               out_features: int, in_features: int) -> Unpacked:
    """AutoAWQ's gemm layout (4 bits) -> Unpacked. name: the layer, for errors."""
    groups = in_features // group
    _check(f"{name}.qweight", qweight, (in_features, out_features // 8), torch.int32)
    _check(f"{name}.qzeros", qzeros, (groups, out_features // 8), torch.int32)
    _check(f"{name}.scales", scales, (groups, out_features))
    order = torch.tensor(AWQ_REVERSE_ORDER, device=qweight.device)

    def unorder(words: torch.Tensor) -> torch.Tensor:  # [r, out / 8] int32 -> [r, out] uint8 in output order
        values = _words_to_values(words, 4).reshape(words.shape[0], -1, 8)  # [r, out / 8, nibble]
        return values[:, :, order].reshape(words.shape[0], -1)

    return Unpacked(unorder(qweight).T.contiguous(), scales.T.contiguous(), unorder(qzeros).T.to(torch.int16),
                    4, group)


def unpack_gptq(name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, bits: int, group: int, zero_offset: int, out_features: int,
                in_features: int) -> Unpacked:
    """GPTQ's layout -> Unpacked. zero_offset: 1 for the "gptq" (v1) format's stored zero - 1, 0 for "gptq_v2".
    Raises CheckpointError for a g_idx that is not the plain i // group (act-order: desc_act)."""
    per, groups = 32 // bits, in_features // group
    _check(f"{name}.qweight", qweight, (in_features // per, out_features), torch.int32)
    _check(f"{name}.qzeros", qzeros, (groups, out_features // per), torch.int32)
    _check(f"{name}.scales", scales, (groups, out_features))
    if g_idx is not None:
        check_plain_groups(f"{name}.g_idx", g_idx, in_features, group)
    codes = _words_to_values(qweight.T.contiguous(), bits)  # [out, in]: word r holds inputs r * per ...
    zeros = _words_to_values(qzeros, bits).to(torch.int16) + zero_offset  # [groups, out]
    return Unpacked(codes, scales.T.contiguous(), zeros.T.contiguous(), bits, group)


def unpack_compressed(name: str, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                      bits: int, group: int | None, packed: bool, out_features: int, in_features: int) -> Unpacked:
    """compressed-tensors' pack-quantized (packed: weight_packed int32 [out, in / 8]) or int-/naive-quantized
    (weight int8 [out, in]) -> Unpacked. group None: one scale per output row (strategy "channel")."""
    group = in_features if group is None else group
    groups, offset = in_features // group, 1 << (bits - 1)
    if packed:
        if bits != 4:
            raise CheckpointError(f"{name}.weight_packed holds {bits}-bit values; only 4-bit packing is mapped")
        _check(f"{name}.weight_packed", weight, (out_features, in_features // 8), torch.int32)
        codes = _words_to_values(weight, 4)  # already q + 8
    else:
        _check(f"{name}.weight", weight, (out_features, in_features), torch.int8)
        codes = (weight.to(torch.int16) + offset).to(torch.uint8)
    _check(f"{name}.weight_scale", scale, (out_features, groups))
    zeros = None
    if zero_point is not None:
        if zero_point.dtype == torch.int32 and zero_point.shape[0] != out_features:  # packed along outputs
            _check(f"{name}.weight_zero_point", zero_point, ((out_features + 7) // 8, groups), torch.int32)
            zero_point = _words_to_values(zero_point.T.contiguous(), bits)[:, :out_features].T.to(torch.int16) - offset
        _check(f"{name}.weight_zero_point", zero_point, (out_features, groups))
        zeros = zero_point.to(torch.int16) + offset
    return Unpacked(codes, scale, zeros, bits, group)


def as_symmetric(name: str, w: Unpacked) -> Unpacked:
    """w, whose zeros a symmetric scheme stores anyway (GPTQ sym), without them: they must all be the middle code.
    Raises CheckpointError where one is not."""
    if w.zeros is not None:
        middle = 1 << (w.bits - 1)
        if not bool((w.zeros == middle).all()):
            raise CheckpointError(f"{name}: the config says symmetric but zero points other than {middle} are stored")
    return Unpacked(w.codes, w.scales, None, w.bits, w.group)


def block_format_of(bits: int, symmetric: bool) -> BlockFormat | None:
    """The block format a scheme's weights map onto exactly (up to float16 scales); None: no such format."""
    return {(4, True): FORMATS["Q4_0"], (4, False): FORMATS["Q4_1"], (8, True): FORMATS["Q8_0"]}.get((bits, symmetric))


def to_blocks(name: str, w: Unpacked) -> tuple[BlockFormat, torch.Tensor]:
    """w -> (its block format, uint8 [out, row_bytes]). Raises CheckpointError where it does not map: a group or
    width that is not a multiple of 32, 8 bits with zero points, a symmetric layer whose zeros are not the middle
    code, a scale float16 cannot hold."""
    out, columns = w.codes.shape
    if w.group % BLOCK or columns % BLOCK:
        raise CheckpointError(f"{name}: groups of {w.group} of {columns} inputs; blocks need multiples of {BLOCK}")
    fmt = block_format_of(w.bits, w.zeros is None)
    if fmt is None:
        raise CheckpointError(f"{name}: {w.bits}-bit weights with zero points have no block format (Q8_0 is "
                              "symmetric)")
    per_block = lambda t: t.float().repeat_interleave(w.group // BLOCK, dim=1).reshape(-1, 1)  # noqa: E731
    d = per_block(w.scales)  # [out * columns / 32, 1] float32
    if not torch.isfinite(d.to(torch.float16)).all():
        raise CheckpointError(f"{name}: a scale of {float(d.abs().max()):.4g} overflows float16 (the blocks' scales)")
    codes = w.codes.reshape(-1, BLOCK)  # [blocks, 32]
    fp16 = lambda v: v.to(torch.float16).view(torch.uint8).reshape(-1, 2)  # noqa: E731
    nibbles = lambda q: q[:, :16] | (q[:, 16:] << 4)  # noqa: E731  (ggml: weight i low, 16 + i high)
    if fmt.name == "Q4_1":
        m = -d * per_block(w.zeros)
        blocks = torch.cat([fp16(d), fp16(m), nibbles(codes)], dim=1)
    elif fmt.name == "Q4_0":
        blocks = torch.cat([fp16(d), nibbles(codes)], dim=1)
    else:
        blocks = torch.cat([fp16(d), (codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)], dim=1)
    return fmt, blocks.reshape(out, fmt.row_bytes(columns))
