"""Half-precision linear layers on a CPU without oneDNN's bf16/fp16 support: float32 products for calls
with many rows.

On such a CPU (AVX2, no AVX512/AMX) torch runs a bfloat16/float16 `F.linear` through its portable half GEMM,
5-8x slower than float32 (SmolLM2 bf16: a 128-token prefill 1.65 s against 0.3 s in float32). A call with
at least `min_rows` rows (prefill chunks, mixed batches, eager decode of many items) therefore converts the
weight to float32 — a slice at a time into one scratch buffer reused by every layer, so the conversion is a
streaming copy (~0.1 ns per weight) and not a fresh allocation (~0.6 ns: page faults) — multiplies in
float32 and rounds the result back to the activations' dtype. Half GEMMs accumulate in float32 as well, so
the numbers differ only in summation order. Calls with fewer rows keep the half GEMM: converting the weights
costs more than it saves below ~5 rows (measured 1.6-1.8x faster at 8 rows, 2.6-3x at 16), and batch-1
decode is the native kernel's (models/decode/native.py), which reads half weights itself. The model runs one
forward at a time (the executor's model thread), so one scratch buffer serves all its layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 8  # rows per call from which the float32 product is used (the conversion pays from ~5 rows)
SCRATCH_ELEMENTS = 4 << 20  # floats (16 MiB): every SmolLM2 layer but the LM head converts in one slice


def onednn_lacks(dtype: torch.dtype) -> bool:
    """Whether torch's CPU matmul for this half dtype is its slow portable one (no oneDNN support)."""
    supported = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}.get(dtype)
    return supported is not None and not supported()


class HalfUpcast:
    """One model's float32 products of half weights (shared by its linear layers)."""

    def __init__(self, min_rows: int = MIN_ROWS, scratch_elements: int = SCRATCH_ELEMENTS) -> None:
        self.min_rows = min_rows
        self._scratch = torch.empty(scratch_elements, dtype=torch.float32)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [T, in] (half), weight: [out, in] (half), bias: [out] or None -> [T, out] in x's dtype."""
        out_features, in_features = weight.shape
        x32 = x.float()
        bias32 = None if bias is None else bias.float()
        step = max(1, self._scratch.numel() // in_features)  # weight rows per slice
        if out_features <= step:
            return F.linear(x32, self._float(weight), bias32).to(x.dtype)
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        for a in range(0, out_features, step):
            b = min(out_features, a + step)
            out[:, a:b] = F.linear(x32, self._float(weight[a:b]), None if bias32 is None else bias32[a:b])
        return out

    def _float(self, weight: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape
        return self._scratch[:rows * cols].view(rows, cols).copy_(weight)
