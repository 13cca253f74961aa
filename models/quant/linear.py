"""Low-precision linear weights: `--quantization int8 | fp16 | int4` (float32 activations, KV and everything else).

Every linear layer's weight (LM head included; the embedding stays in the model dtype, since one row per
token is read) is stored in fewer bytes. Decode at small batch sizes is bound by reading the weights, so
fewer bytes per step is the point.

- int8: one int8 per weight and one float32 scale per output channel (symmetric, absmax / 127). On x86
  CPUs with FBGEMM: its dynamic int8 GEMM, with the activations quantized per row to ~14 bits in two passes
  (Int8Weight._fbgemm says how and why), so the result is that of the int8 weights and a row never depends
  on its batch. Elsewhere (CUDA, CPUs without FBGEMM): weight-only, the int8 weight converted to the
  activation dtype inside each call, scales applied to the output: correct everywhere, a memory saving, not
  a speed-up (on CPUs widened a tile at a time, so that no float copy of a whole matrix exists). torch's
  weight-only `_weight_int8pack_mm` measured 10-15x slower than float32 on this AVX2-only CPU, so it is not used.
  One copy of the weights: FBGEMM's packed layout holds them where the eager forward runs decode steps; where
  the native step does (or --deterministic), the executor keeps the plain int8 weights instead (force_dequant:
  executor_service/step/decode_choice.py `keeps_plain_int8`), which the step reads in place, and the eager
  calls (prompt chunks) dequantize them.
- int4: llama.cpp's Q4_1 blocks (32 weights share a float16 scale d and minimum m: w = d * q + m, q in 0..15;
  5 bits per weight), made by models/quant/block_quantize.py and computed by the block kernels (BlockWeight,
  models/quant/blocks.py), the same that run GGUF files. Q4_1 over Q4_0 (4.5 bits, symmetric): 10-20% less
  error per layer, measured on SmolLM2-135M's layers with the blocks shifted off the grid of the Q4_1 file it
  was made from (output error 0.075 vs 0.089), Gaussian (0.077 vs 0.085) and Student-t weights (0.10 vs 0.13).
  The LM head gets Q8_0 (as llama.cpp keeps its output matrix at 6+ bits: its errors reach every logit).
- fp16: float16 weights, float32 compute: FBGEMM's fp16 GEMM (x86 CPUs) converts the weight inside its
  kernel. Weight-only, rows independent. On CUDA use --dtype float16 / bfloat16 instead.

The float weights are dropped once quantized (the Linear keeps an empty `weight` of the right dtype and
device, so code reading `weight.dtype` / `.device` still works); with tied embeddings the LM head's
weight is the embedding's and stays. Quality against float32 and speed: docs/performance.md.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.memory.huge_pages import copy_to_huge_pages
from models.memory.mapped_pages import release_file_pages
from models.quant.blocks import BlockWeight
from models.quant.block_formats import FORMATS
from models.quant.block_quantize import BLOCK, quantize_blocks

QUANTIZATIONS = ("none", "int8", "fp16", "int4")
INT4_FORMAT = "Q4_1"  # --quantization int4's block format (see the module docstring for the measurement)
INT4_HEAD_FORMAT = "Q8_0"  # ... and the LM head's
DEQUANT_TILE = 1 << 22  # int8 weights widened per step of the portable kernel on CPUs (16 MB of float32)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> int8 [out, in] and float32 scales [out]: symmetric, absmax / 127 per row."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # an all-zero row keeps a finite scale
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


class Fp16Weight:
    """One linear layer's weight stored in float16, computed in float32: FBGEMM's fp16 GEMM (x86 CPUs),
    which converts the weight to float32 inside its kernel. Weight-only: rows are independent of each other."""

    kernel = "fbgemm-fp16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        b = None if bias is None else bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous().float(), self._packed).to(x.dtype)


class Int8Weight:
    """One linear layer's int8 weight and the function computing `x @ W.T + b` with it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_fbgemm: bool) -> None:
        q, scales = quantize_per_channel(weight)  # [out, in] int8, [out] float32
        self.out_features, self.in_features = q.shape
        self.kernel = "fbgemm-int8" if use_fbgemm else "dequant-int8"
        if use_fbgemm:
            zero = torch.zeros(q.shape[0], dtype=torch.int64)
            with warnings.catch_warnings():  # "quantized tensors are deprecated": this op still needs one
                warnings.simplefilter("ignore", UserWarning)
                qw = torch._make_per_channel_quantized_tensor(q, scales.double(), zero, 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, None)  # bias added after the row rescale
            self._pin = torch.zeros(1, q.shape[1])  # the range-pinning row, see _fbgemm
            self._pin[0, :2] = torch.tensor([1.0, -1.0])
            self.qweight = self.scales = None
            self.bias = None if bias is None else bias.detach().float()
        else:
            self._packed = None
            self.qweight, self.scales = q.to(weight.device), scales.to(weight.device, weight.dtype)
            self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self._packed is not None:
            return self._fbgemm(x)
        if self.qweight.device.type == "cpu" and self.qweight.numel() > DEQUANT_TILE:
            out = self._dequant_tiles(x)
        else:
            out = F.linear(x, self.qweight.to(x.dtype)) * self.scales
        return out if self.bias is None else out + self.bias

    def _dequant_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T * scales on a CPU, the int8 weight widened DEQUANT_TILE weights at a time: widened whole, a
        float copy of the matrix (4x its int8 bytes: ~400 MB for a 1.7B model's LM head) would exist during every
        call, which is what keeping the weights as int8 is meant to avoid."""
        rows = max(1, DEQUANT_TILE // self.in_features)
        out = torch.empty(self.out_features, x.shape[0], dtype=x.dtype)  # [out, T]: a tile's rows are contiguous
        xt = x.T  # [in, T]
        for start in range(0, self.out_features, rows):
            torch.matmul(self.qweight[start:start + rows].to(x.dtype), xt, out=out[start:start + rows])
        return out.T.contiguous().mul_(self.scales)  # [T, out]

    def _fbgemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with FBGEMM's dynamic int8 GEMM, as exact as the int8 weights allow.

        The op quantizes its input to 7 bits (reduce_range: without VNNI, FBGEMM sums pairs of u8 x s8
        products in int16, which saturates with 8 bits) with one scale and zero point per call, from the
        min and max of the whole input. Used as is, that costs ~1.5% of a row's output and makes a row depend
        on its neighbours (measured: 12% of the logits' range between a sequence alone and beside a prompt
        chunk). So:
        - one extra row [1, -1, 0, ...] pins the input's range to [-1, 1]: the op's scale is then always
          2/127 with zero point 64 (grid values (q - 64) * 2/127, q in 0..127);
        - every row is divided by its own absmax (x 126/127, so its largest value is on the grid), and split
          into its value rounded to that grid (`hi`, which the op quantizes exactly) and the remainder x 127
          (`lo`, within [-1, 1]); the output is op(hi) + op(lo) / 127, rescaled by the row's absmax.
        Each row is thus quantized on its own to ~14 bits (weight-only int8 quality: 1e-4 of the output against
        the dequantized weights, 2e-2 for the plain op) and alone or in any batch gives the same bits. The
        GEMM gets 2T + 1 rows instead of T: at decode sizes it is bound by reading the weight, which is read
        once either way."""
        # Every elementwise op here is a dispatch of a few microseconds on a [T, in] row block: at batch 1
        # they cost as much as the GEMM, so they are few, in place, into one preallocated [2T + 1, in] input.
        dtype, x = x.dtype, x.float()
        rows = x.shape[0]
        inv = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).reciprocal_().mul_(126 / 127)  # [T, 1]
        buf = torch.empty(2 * rows + 1, x.shape[1], dtype=torch.float32)  # [lo; hi; pin]
        lo, hi = buf[:rows], buf[rows:2 * rows]
        torch.mul(x, inv, out=lo)  # x / absmax, in [-126/127, 126/127]
        torch.mul(lo, 63.5, out=hi).round_().mul_(1 / 63.5)  # on the op's grid (k * 2/127, |k| <= 63)
        lo.sub_(hi).mul_(127)  # the remainder, |.| <= 1/127, scaled to [-1, 1]
        buf[2 * rows:] = self._pin
        out = torch.ops.quantized.linear_dynamic(buf, self._packed, True)  # [2T + 1, out]
        out = torch.add(out[rows:2 * rows], out[:rows], alpha=1 / 127).div_(inv)  # [T, out]
        return (out if self.bias is None else out.add_(self.bias)).to(dtype)


def move_int8_to_huge_pages(model: nn.Module, mode: str) -> int:
    """The plain int8 weights of `model`'s Int8Weights (those the native step reads in place) moved into one
    huge-page arena, as move_parameters_to_huge_pages does for parameters (they are not parameters); returns how
    many. mode: --huge-pages."""
    held = [m.quant for m in model.modules()
            if isinstance(getattr(m, "quant", None), Int8Weight) and m.quant.qweight is not None
            and m.quant.qweight.device.type == "cpu"]
    for q, moved in zip(held, copy_to_huge_pages([q.qweight for q in held], mode)):
        q.qweight = moved  # (the heap copy goes with its last reference)
    return len(held)


def fbgemm_usable(mode: str) -> bool:
    """FBGEMM's kernel for `mode` is built in and gives the right numbers (checked on a small product)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(64, 256, generator=g), torch.randn(3, 256, generator=g)
        layer = Fp16Weight(w, None) if mode == "fp16" else Int8Weight(w, None, use_fbgemm=True)
        got, want = layer(x), x @ w.T
    except (RuntimeError, AttributeError):  # op missing from this torch build
        return False
    return bool((got - want).abs().max() <= 0.05 * want.abs().max())


def block_weight(weight: torch.Tensor, bias: torch.Tensor | None,
                 fmt_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """weight [out, in] quantized to `fmt_name` blocks, as the BlockWeight that computes with them."""
    fmt = FORMATS[fmt_name]
    return BlockWeight([(fmt, quantize_blocks(weight, fmt))], weight.shape[1], None if bias is None else bias.detach())


def quantize_linears(model: nn.Module, mode: str, is_linear: Callable[[nn.Module], bool],
                     force_dequant: bool = False) -> str | None:
    """Quantizes every linear layer of `model` (those `is_linear` accepts) in place: each gets `.quant` and
    loses its float weight. Returns the kernel used ("fbgemm-int8", "dequant-int8", "fbgemm-fp16", "blocks-Q4_1"),
    None for mode "none". force_dequant: int8's portable kernel even where FBGEMM works (tests of the fallback).
    Raises ValueError for a mode this device or model cannot run (nothing is changed then)."""
    if mode == "none":
        return None
    if mode not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {mode!r}; choose {', '.join(QUANTIZATIONS)}")
    linears = [m for m in model.modules() if is_linear(m)]
    if not linears:  # (every linear layer already in blocks: a GGUF file, a pre-quantized checkpoint)
        return None
    if mode == "int4":
        _check_int4(model, linears)
        head = getattr(model, "lm_head", None)
        kernel = f"blocks-{INT4_FORMAT}"

        def make(m: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
            return block_weight(m.weight, m.bias, INT4_HEAD_FORMAT if m is head else INT4_FORMAT)
    else:
        fbgemm = linears[0].weight.device.type == "cpu" and not force_dequant and fbgemm_usable(mode)
        if mode == "fp16" and not fbgemm:
            raise ValueError("--quantization fp16 needs FBGEMM (x86 CPU); on CUDA use --dtype float16 or bfloat16")
        if fbgemm:
            torch.backends.quantized.engine = "fbgemm"
        kernel = ("fbgemm-" if fbgemm else "dequant-") + mode

        def make(m: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
            return Fp16Weight(m.weight, m.bias) if mode == "fp16" else Int8Weight(m.weight, m.bias, fbgemm)
    tied = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    with torch.no_grad():
        for m in linears:
            m.quant = make(m)
            if id(m.weight) not in tied:  # the float copy is no longer read; a tied one is the embedding
                release_file_pages([m.weight.detach()])  # (its pages in the mapped checkpoint: read just now)
                m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
    return kernel


def _check_int4(model: nn.Module, linears: list[nn.Module]) -> None:
    """Raises ValueError (before anything is changed) off CPUs (where the block kernels run) or for a layer whose
    input size does not split into blocks."""
    if linears[0].weight.device.type != "cpu":
        raise ValueError(f"--quantization int4 runs on the block kernels, on CPUs; this model is on "
                         f"{linears[0].weight.device.type} (use int8 or --dtype float16 / bfloat16 there)")
    names = {id(m): n for n, m in model.named_modules()}
    odd = [f"{names[id(m)]} ({m.in_features})" for m in linears if m.in_features % BLOCK]
    if odd:
        raise ValueError(f"--quantization int4 needs every linear layer's input size to be a multiple of {BLOCK} "
                         f"(llama.cpp's blocks); not {', '.join(odd[:3])}")
