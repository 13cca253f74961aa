"""Decoder-only transformer (Llama, Qwen2, Qwen3) over a packed batch of tokens and a paged KV cache.

Every linear layer runs once per step on `[T, hidden]` (all items' tokens flattened). The q/k/v
projections are fused into one matmul; the loader concatenates the checkpoint's separate tensors.

On CPU in float32, `DecoderModel.pack_cpu_weights` gives every linear layer (LM head included) a copy of its
weight pre-packed in oneDNN's blocked layout, used for calls of at most PACKED_MAX_TOKENS rows: decode steps
and small chunks. For those skinny products MKL's sgemm (F.linear) re-packs the whole weight on every call
and splits poorly over threads (batch 32 on 2 threads: ~1.3x slower per decode step; the 49152-wide LM head
~2x slower). Large prefill chunks keep F.linear, which is as fast or faster there. The cost is a second copy
of the linear weights in memory.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionMetadata
from models.config import ModelConfig
from models.decode_attention import DecodeMetadata
from models.half_upcast import HalfUpcast, onednn_lacks
from models.kv_cache import PagedKvCache
from models.lora_batch import LoraBatch
from models.moe import SparseMoeBlock
from models.quantization import Fp16Weight, Int8Weight, quantize_linears
from models.rope import RotaryEmbedding, apply_rotary


PACKED_MAX_TOKENS = 512  # rows per call up to which the packed weights are used (measured crossover ~512-2048)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict) with an optional oneDNN pre-packed weight for small calls."""

    packed: torch.Tensor | None = None  # opaque mkldnn tensor [out, in], set by DecoderModel.pack_cpu_weights
    quant: Int8Weight | Fp16Weight | None = None  # set by DecoderModel.quantize (models/quantization.py)
    upcast: HalfUpcast | None = None  # set by DecoderModel.upcast_cpu_half_linears (models/half_upcast.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self.quant is not None:
            return self.quant(x)
        if self.upcast is not None and x.shape[0] >= self.upcast.min_rows and not torch.compiler.is_compiling():
            return self.upcast.linear(x, self.weight, self.bias)
        # Compiled (models/compiled_decode.py), the compiler packs the weights itself (inductor freezing).
        if self.packed is not None and x.shape[0] <= PACKED_MAX_TOKENS and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKvCache,
                meta: AttentionMetadata | DecodeMetadata, lora: LoraBatch | None) -> torch.Tensor:
        # x: [T, hidden]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        if lora is not None:
            lora.apply(qkv, x, self.layer, "qkv")
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.heads + self.kv_heads, self.head_dim)  # [T, heads + kv_heads, d]
        if self.q_norm is not None:
            q, k = qk.split([self.heads, self.kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = apply_rotary(qk, cos, sin)  # q and k rotated together: half the small ops
        q, k = qk.split([self.heads, self.kv_heads], dim=1)  # [T, heads, d], [T, kv_heads, d]
        v = v.view(-1, self.kv_heads, self.head_dim)
        out = meta.attend(q, k, v, cache, self.layer, self.scale)  # [T, heads * d]
        return self.o_proj(out) if lora is None else lora.apply(self.o_proj(out), out, self.layer, "o")


class MLP(nn.Module):
    # gate and up stay separate matmuls: fused, the halves are strided views and the elementwise
    # silu * up on them measured ~5% slower per decode step on CPU than two contiguous outputs.
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        if lora is not None:
            gate = lora.apply(self.gate_proj(x), x, self.layer, "gate")
            mid = F.silu(gate, inplace=True).mul_(lora.apply(self.up_proj(x), x, self.layer, "up"))
            return lora.apply(self.down_proj(mid), mid, self.layer, "down")
        # In place on the fresh [T, inter] gate output: a prefill chunk's intermediates are ~12 MB each, and
        # on CPU every such new buffer is page-faulted in again (glibc trims the freed heap), which made
        # silu and mul cost as much as half a matmul; two fewer buffers measured ~1.15x on the MLP at T=2048.
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg, layer) if cfg.is_moe_layer(layer) else MLP(cfg, layer)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKvCache,
                meta: AttentionMetadata | DecodeMetadata, lora: LoraBatch | None = None) -> torch.Tensor:
        # Residual adds in place on the sublayers' fresh outputs (a + h == h + a bit for bit): one [T, hidden]
        # buffer fewer each, which on CPU spares large prefill chunks a page-faulted allocation.
        h = self.self_attn(self.input_layernorm(h), cos, sin, cache, meta, lora).add_(h)
        return self.mlp(self.post_attention_layernorm(h), lora).add_(h)


class DecoderModel(nn.Module):
    """Parameter names mirror HF's (`model.layers.N...`, `lm_head`) except the fused qkv_proj."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None  # set by the loader once the device is known
        self.weights_version = 0  # bumped whenever weights change in place (quantize): kernels holding raw
        # pointers to the weights (models/native_decode.py) rebuild their descriptors

    def init_rotary(self, device: torch.device) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device)

    def quantize(self, mode: str, force_dequant: bool = False) -> str | None:
        """Low-precision linear weights (models/quantization.py); returns the kernel used, None for "none"."""
        self.weights_version += 1
        return quantize_linears(self, mode, lambda m: isinstance(m, Linear), force_dequant)

    def pack_cpu_weights(self) -> bool:
        """Pre-packs every linear weight for oneDNN (see the module docstring). Only on CPU, float32, with
        mkldnn built in; a no-op elsewhere. Checks one packed product against F.linear and falls back (no
        packing) if the internal ops are missing or disagree. Returns whether the packed path is on."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        weight = self.lm_head.weight
        if any(m.quant is not None for m in linears):
            return False  # quantized weights have their own kernels
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return False
        try:
            with torch.no_grad():
                for m in linears:
                    m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
                probe = self.lm_head
                x = torch.randn(3, probe.in_features, generator=torch.Generator().manual_seed(0))
                want = F.linear(x, probe.weight)
                if not torch.allclose(probe(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                    raise RuntimeError("packed linear disagrees with F.linear")
        except (RuntimeError, AttributeError):  # op missing in this torch build, or wrong numbers
            for m in linears:
                m.packed = None
            return False
        return True

    def upcast_cpu_half_linears(self) -> bool:
        """bfloat16/float16 weights on a CPU where oneDNN lacks that type: every linear layer computes calls of
        many rows in float32 (models/half_upcast.py). A no-op elsewhere; returns whether it is on."""
        weight = self.lm_head.weight
        if weight.device.type != "cpu" or not onednn_lacks(weight.dtype):
            return False
        upcast = HalfUpcast()
        for m in self.modules():
            if isinstance(m, Linear) and m.quant is None:
                m.upcast = upcast
        return True

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata | DecodeMetadata, cache: PagedKvCache,
                logit_rows: torch.Tensor | None, lora: LoraBatch | None = None) -> torch.Tensor:
        """input_ids: [T]; logit_rows: [R] indices into the packed tokens whose logits are wanted (None: all,
        R = T). Returns float32 logits [R, vocab]; the LM head runs on those R rows only."""
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(meta.positions, h.dtype)  # [T, head_dim] each
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache, meta, lora)
        h = self.model.norm(h if logit_rows is None else h[logit_rows])  # [R, hidden]
        return self.lm_head(h).float()  # [R, vocab]
