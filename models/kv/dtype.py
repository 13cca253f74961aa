"""The KV pool's element type (`--kv-dtype`) and the conversions on its way in and out.

auto: the weights' dtype (bfloat16 by default on CUDA, models/loader.py; float32 on CPU). Another dtype makes
the pool smaller (bfloat16/float16 beside float32 weights: half; fp8_e4m3 beside float32: a quarter, beside
bfloat16: half) at the price of precision: K/V are converted as they are written into the pool (`store_kv`) and
back to the activations' dtype as they are read (`load_kv`). The gathered and decode paths convert the rows
they gather; the flex path gathers the batch's blocks (each once) converted, instead of reading the pool in
place (models/attention/flex.py). The native CPU decode step reads the pool as the weights' dtype: it refuses
such a pool (models/native_decode.native_refusal), so decode steps run the PyTorch forward, and
`--decode-kernel native` (or --deterministic) beside it exits 2 with the reason.

fp8_e4m3: K/V stored as float8_e4m3fn, stored = x / scale, read = stored * scale, with one float32 scale per
tensor. The pool uses FP8_KV_SCALE (1.0) for every layer's K and V, vLLM's default for a checkpoint without
calibrated k_scale/v_scale: e4m3 covers +-448 with 3 mantissa bits, so K/V of ordinary magnitudes keep about
6% relative precision; larger values saturate (never NaN: e4m3fn has no infinity). `Fp8Kv` is the same round
trip with a chosen scale (tests/models/test_kv_dtype.py).
"""
from __future__ import annotations

import torch

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
FP8_KV_SCALE = 1.0  # stored = x / scale in every layer's K and V pool (see the module docstring)


def resolve_kv_dtype(name: str, weights: torch.dtype) -> torch.dtype:
    """The pool dtype for --kv-dtype `name` beside weights of dtype `weights` (ValueError: an unknown name)."""
    if name not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    if name == "auto":
        return weights
    return FP8 if name == "fp8_e4m3" else getattr(torch, name)


def store_kv(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x: [n, kv_heads, d] written at the flat slots `slots` [n] of one layer's pool [blocks, block_size,
    kv_heads, d], converted to the pool's dtype (fp8: divided by the scale and saturated to e4m3's range)."""
    flat = pool.view(-1, *x.shape[1:])
    if pool.dtype == x.dtype:
        flat.index_copy_(0, slots, x)
    elif pool.dtype == FP8:
        scaled = (x.float() / FP8_KV_SCALE).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        # through a byte view: index_copy_ has no float8 kernel on CPU (torch 2.13)
        flat.view(torch.uint8).index_copy_(0, slots, scaled.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, x.to(pool.dtype))


def load_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read out of a pool (any shape), in the activations' dtype `dtype` (fp8: times the scale)."""
    if rows.dtype == dtype:
        return rows
    if rows.dtype == FP8:
        out = rows.to(dtype)
        return out if FP8_KV_SCALE == 1.0 else out * FP8_KV_SCALE
    return rows.to(dtype)


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The --kv-dtype spelling of a pool dtype (GetInfoResponse.kv_dtype)."""
    return "fp8_e4m3" if dtype == FP8 else str(dtype).removeprefix("torch.")


class Fp8Kv:
    """One pool tensor in float8_e4m3fn with a per-tensor float32 scale."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, scale: float = 1.0) -> None:
        self.data = torch.zeros(shape, dtype=FP8, device=device)
        self.scale = torch.tensor(scale, dtype=torch.float32, device=device)

    @staticmethod
    def scale_for(x: torch.Tensor) -> float:
        """The scale that maps x's largest magnitude to e4m3's largest finite value (1.0 for all zeros)."""
        peak = float(x.abs().max()) if x.numel() else 0.0
        return peak / FP8_MAX if peak > 0 else 1.0

    def store(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x: [n, ...] written at flat rows `slots` of the pool (viewed [rows, ...]), divided by the scale and
        saturated to e4m3's range (a value past it would become NaN: e4m3fn has no infinity)."""
        flat = self.data.view(-1, *x.shape[1:])
        scaled = (x.float() / self.scale).clamp_(-FP8_MAX, FP8_MAX)
        # through a byte view: index_copy_ has no float8 kernel on CPU (torch 2.13)
        flat.view(torch.uint8).index_copy_(0, slots, scaled.to(FP8).view(torch.uint8))

    def load(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows `slots` back in `dtype`: stored * scale."""
        flat = self.data.view(-1, *self.data.shape[-2:])
        rows = flat.view(torch.uint8).index_select(0, slots).view(FP8)
        return (rows.float() * self.scale).to(dtype)
