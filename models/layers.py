"""The shared layers every family is built from: Linear (with the CPU packed / quantized / half-upcast
paths), RMSNorm (plain or Gemma's (1 + weight)), attention over the paged cache and the gated MLP. What a
family changes is read from ModelConfig (models/config.py); the layer order is models/transformer.py's.

On CPU in float32, with the eager decode step, `DecoderModel.pack_cpu_weights` lays every linear layer's
weight (an untied LM head included) out in oneDNN's blocked layout in place of the plain one. For the skinny
products of decode steps and small chunks MKL's sgemm (F.linear) re-packs the whole weight on every call and
splits poorly over threads (batch 32 on 2 threads: ~1.3x slower per decode step; the 49152-wide LM head ~2x
slower). Large prefill chunks multiply with the packed weight too (F.linear was as fast or faster there, but
keeping the plain weight for them would hold every weight twice). The native and compiled decode steps read
the plain weights, so they run without packing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.attention.paged import AttentionMetadata
from models.attention.spec import AttentionSpec
from models.config import ModelConfig
from models.attention.decode import DecodeMetadata
from models.half_upcast import HalfUpcast
from models.kv.paged_cache import PagedKvCache
from models.lora.batch import LoraBatch
from models.memory.mapped_pages import release_file_pages
from models.quant.blocks import BlockWeight, stand_in
from models.quant.linear import Fp16Weight, Int8Weight
from models.rope import apply_rotary

PACKED_MAX_TOKENS = 512  # rows per call up to which the packed weights are used (measured crossover ~512-2048)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict) with an optional oneDNN pre-packed weight for small calls."""

    packed: torch.Tensor | None = None  # opaque mkldnn tensor [out, in], set by DecoderModel.pack_cpu_weights
    # set by DecoderModel.quantize (models/quant/linear.py), or by the GGUF loader for weights kept in their
    # block format (models/quant/blocks.py; `weight` is then a stand-in of its shape and dtype)
    quant: Int8Weight | Fp16Weight | BlockWeight | None = None
    upcast: HalfUpcast | None = None  # set by DecoderModel.upcast_cpu_half_linears (models/half_upcast.py)
    plain_dropped = False  # the packed weight replaced the plain one (drop_plain_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self.quant is not None:
            return self.quant(x)
        if self.upcast is not None and x.shape[0] >= self.upcast.min_rows and not torch.compiler.is_compiling():
            return self.upcast.linear(x, self.weight, self.bias)
        # Compiled (models/decode/compiled.py), the compiler packs the weights itself (inductor freezing).
        if self.packed is not None and (x.shape[0] <= PACKED_MAX_TOKENS or self.plain_dropped) \
                and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def drop_plain_weight(self) -> None:
        """With `packed` set: the plain weight's memory goes (its pages in the mapped checkpoint released, a
        copy freed); `weight` becomes a stand-in of its shape, dtype and device (one element, expanded) for
        code that reads those, and the packed weight serves every call."""
        assert self.packed is not None
        release_file_pages([self.weight.detach()])
        self.weight = stand_in(tuple(self.weight.shape), self.weight.dtype, self.weight.device)
        self.plain_dropped = True


class RMSNorm(nn.Module):
    """RMSNorm; with offset (Gemma) it multiplies by (1 + weight), in float32 before the cast back."""

    def __init__(self, size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:  # transformers' Gemma RMSNorm, op for op
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op; bit-equal in fp32
        # Half precision: normalise in float32 and cast back before the weight, exactly as transformers does.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # q/k norms: per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2).
        self.whole_qk_norm = cfg.qk_norm_whole
        q_norm, k_norm = (cfg.q_size, cfg.kv_size) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_norm, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None  # GPT-OSS
        self.spec = AttentionSpec(cfg.head_dim ** -0.5 if cfg.attn_scale is None else cfg.attn_scale,
                                  cfg.window_of(layer), cfg.attn_softcap)

    @property
    def scale(self) -> float:
        return self.spec.scale

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, cache: PagedKvCache,
                meta: AttentionMetadata | DecodeMetadata, lora: LoraBatch | None) -> torch.Tensor:
        # x: [T, hidden]; rope: this layer's (cos, sin) [T, rotary_dim] each, None for a layer without RoPE
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        if lora is not None:
            lora.apply(qkv, x, self.layer, "qkv")
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        if self.whole_qk_norm:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=-1)
        qk = qk.view(-1, self.heads + self.kv_heads, self.head_dim)  # [T, heads + kv_heads, d]
        if self.q_norm is not None and not self.whole_qk_norm:
            q, k = qk.split([self.heads, self.kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if rope is not None:
            qk = apply_rotary(qk, *rope)  # q and k rotated together: half the small ops
        q, k = qk.split([self.heads, self.kv_heads], dim=1)  # [T, heads, d], [T, kv_heads, d]
        v = v.view(-1, self.kv_heads, self.head_dim)
        out = meta.attend(q, k, v, cache, self.layer, self.spec, self.sinks)  # [T, heads * d]
        return self.o_proj(out) if lora is None else lora.apply(self.o_proj(out), out, self.layer, "o")


class MLP(nn.Module):
    # gate and up stay separate matmuls: fused, the halves are strided views and the elementwise
    # silu * up on them measured ~5% slower per decode step on CPU than two contiguous outputs.
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gelu = cfg.hidden_act == "gelu_tanh"  # GeGLU (Gemma), else SwiGLU
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def _act(self, gate: torch.Tensor) -> torch.Tensor:
        # In place on the fresh [T, inter] gate output: a prefill chunk's intermediates are ~12 MB each, and
        # on CPU every such new buffer is page-faulted in again (glibc trims the freed heap), which made
        # silu and mul cost as much as half a matmul; two fewer buffers measured ~1.15x on the MLP at T=2048.
        return F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate, inplace=True)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        if lora is not None:
            gate = lora.apply(self.gate_proj(x), x, self.layer, "gate")
            mid = self._act(gate).mul_(lora.apply(self.up_proj(x), x, self.layer, "up"))
            return lora.apply(self.down_proj(mid), mid, self.layer, "down")
        return self.down_proj(self._act(self.gate_proj(x)).mul_(self.up_proj(x)))
