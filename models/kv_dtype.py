"""The KV pool's element type (`--kv-dtype`) and the fp8 KV codec.

auto: the weights' dtype (bfloat16 by default on CUDA, models/loader.py; float32 on CPU). An explicit dtype
equal to the weights' is the same. A KV dtype other than the weights' needs the attention paths to convert on
write and read; today's paths (gathered, flex, native) write and read the pool in the activations' dtype, so
such a choice is refused at start with what would take it (docs/cuda.md: fp8 KV waits for FlashInfer's
kv_data_type on a GPU).

fp8_e4m3: K/V stored as float8_e4m3fn with one float32 scale per tensor (per layer's K and V pool): stored
= x / scale, read = stored * scale, the scale chosen so the largest magnitude maps to e4m3's 448. `Fp8Kv`
is that round trip, tested on CPU (tests/models/test_kv_dtype.py).
"""
from __future__ import annotations

import torch

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def resolve_kv_dtype(name: str, weights: torch.dtype) -> torch.dtype:
    """The pool dtype for --kv-dtype `name` beside weights of dtype `weights`; ValueError when it cannot run."""
    if name not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    if name == "auto":
        return weights
    dtype = FP8 if name == "fp8_e4m3" else getattr(torch, name)
    if dtype != weights:
        raise ValueError(f"--kv-dtype {name} beside {str(weights).removeprefix('torch.')} weights: the attention "
                         "paths of this build read and write the KV pool in the weights' dtype (fp8 KV waits for "
                         "FlashInfer's fp8 kernels on a GPU, docs/cuda.md); use --kv-dtype auto")
    return dtype


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
