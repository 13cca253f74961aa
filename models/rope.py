"""Rotary position embeddings: inverse frequencies for every rope_type we honour, and their application.

Formulas follow transformers' `modeling_rope_utils` so logits match to float rounding.

Partial rotary (`partial_rotary_factor` < 1, Phi-4-mini): only the first `rotary_dim` features of each head
rotate, the rest pass through. LongRoPE (`longrope`, Phi-3's older name `su`): short factors for positions
below `original_max_position_embeddings`, long factors from there on, chosen per token. transformers picks
one set per forward by the longest position in it, so the two agree for a sequence generated token by token
(each step's longest position is its own) and for every prompt within the original length.
"""
from __future__ import annotations

import math

import torch

from models.config import RopeConfig
from tandem.errors import CheckpointError


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """Features of each head that rotate (head_dim unless partial_rotary_factor < 1)."""
    dim = int(head_dim * float(rope.params.get("partial_rotary_factor", 1.0)))
    if dim <= 0 or dim % 2:
        raise CheckpointError(f"partial_rotary_factor {rope.params.get('partial_rotary_factor')!r} gives "
                              f"{dim} rotary features of {head_dim}; it needs an even number above 0")
    return dim


def inv_freq_and_scale(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                       long: bool = False) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [rotary_dim/2] float32, attention scaling applied to cos/sin). long: LongRoPE's long
    factors (else its short ones; other kinds ignore it)."""
    dim = rotary_dim(rope, head_dim)
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base ** exponents)
    p = rope.params
    if rope.kind == "default":
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if rope.kind == "dynamic":
        # Dynamic NTK only changes the frequencies for sequences longer than max_position_embeddings, and
        # Tandem never runs past that limit (OUT_OF_RANGE), so inside it this equals the default rope.
        return inv_freq, 1.0
    if rope.kind == "llama3":
        return _llama3(inv_freq, p), 1.0
    if rope.kind == "yarn":
        return _yarn(p, base, dim, max_position_embeddings)
    if rope.kind in ("longrope", "su"):
        return _longrope(p, exponents, base, max_position_embeddings, long)
    raise CheckpointError(f"unsupported rope_type {rope.kind!r} "
                          "(supported: default, linear, dynamic, llama3, yarn, longrope)")


def _longrope(p: dict, exponents: torch.Tensor, base: float, max_pos: int, long: bool) -> tuple[torch.Tensor, float]:
    orig = float(p["original_max_position_embeddings"])
    factor = p.get("factor") or max_pos / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * base ** exponents), float(attention_factor)


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(p: dict, base: float, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = float(p["original_max_position_embeddings"])
    factor = p.get("factor") or max_pos / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero, as transformers does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding:
    """Computes cos/sin for arbitrary positions (no table: positions may be anywhere up to the max length)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, device: torch.device) -> None:
        inv_freq, self.scale = inv_freq_and_scale(rope, head_dim, max_position_embeddings)
        self.inv_freq = inv_freq.to(device)  # [rotary_dim/2] float32
        # LongRoPE: positions from `long_from` on use the long factors (see the module docstring).
        self.long_inv_freq: torch.Tensor | None = None
        self.long_from = 0
        if rope.kind in ("longrope", "su"):
            self.long_inv_freq = inv_freq_and_scale(rope, head_dim, max_position_embeddings, long=True)[0].to(device)
            self.long_from = int(rope.params["original_max_position_embeddings"])

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64 -> cos, sin: [T, rotary_dim], computed in float32 like transformers.
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            long = positions.to(torch.float32)[:, None] * self.long_inv_freq[None, :]
            freqs = torch.where((positions >= self.long_from)[:, None], long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def cos_sin_mrope(self, positions: torch.Tensor, section: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE (Qwen2.5-VL): positions [3, T] int64 (temporal, height, width) -> cos, sin [T, rotary_dim]; the
        first section[0] frequencies turn by the temporal position, the next section[1] by the height, the rest by
        the width (transformers' recomposition_frequencies), in float32 like transformers."""
        freqs = positions.to(torch.float32)[:, :, None] * self.inv_freq  # [3, T, rotary_dim/2]
        axis = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(section)]).to(freqs.device)
        freqs = freqs.gather(0, axis.expand(1, freqs.shape[1], -1))[0]  # [T, rotary_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos/sin: [T, rotary_dim] (non-interleaved halves, as in HF Llama/Qwen).
    if cos.shape[-1] != x.shape[-1]:  # partial rotary: the first rotary_dim features turn, the rest pass
        dim = cos.shape[-1]
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [T, heads, head_dim], a fresh buffer
    rotated[..., :half].neg_()  # (-x2, x1): negation is exact, so this equals negating before the cat
    # x * cos + rotated * sin with two of its three products done in place (fewer large buffers in prefill).
    return (x * cos[:, None, :]).add_(rotated.mul_(sin[:, None, :]))
