"""Decoder-only transformer over a packed batch of tokens and a paged KV cache: every family Tandem serves
(models/families/), from the shared layers of models/layers.py.

Every linear layer runs once per step on `[T, hidden]` (all items' tokens flattened). The q/k/v
projections are fused into one matmul; the loader concatenates the checkpoint's separate tensors.

A layer's norms sit where its family puts them (ModelConfig.layout): `pre` (Llama: input_layernorm before
attention, post_attention_layernorm before the MLP), `sandwich` (Gemma 2/3: also post_attention_layernorm
after attention and pre/post_feedforward_layernorm around the MLP) or `post` (OLMo 2: only after each
sublayer). Parameter names are the checkpoint's in every layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.attention.paged import AttentionMetadata
from models.config import ModelConfig
from models.attention.decode import DecodeMetadata
from models.half_upcast import HalfUpcast, onednn_lacks
from models.kv.paged_cache import PagedKvCache
from models.layers import MLP, PACKED_MAX_TOKENS, Attention, Linear, RMSNorm  # noqa: F401  (re-exported)
from models.lora.batch import LoraBatch
from models.memory.mapped_pages import mappings_as_of_now
from models.moe import SparseMoeBlock
from models.quant.linear import quantize_linears
from models.rope import RotaryEmbedding

MultimodalRows = tuple[torch.Tensor, torch.Tensor]  # (packed token rows [M], their embeddings [M, hidden])
Rope = tuple[torch.Tensor, torch.Tensor] | None  # one layer's (cos, sin) [T, rotary_dim] each; None: no RoPE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layout = cfg.layout
        self.residual_scale = cfg.residual_scale
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)  # noqa: E731
        if cfg.layout != "post":
            self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = norm()
        if cfg.layout == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if cfg.layout != "pre":
            self.post_feedforward_layernorm = norm()
        self.mlp = SparseMoeBlock(cfg, layer) if cfg.is_moe_layer(layer) else MLP(cfg, layer)

    def forward(self, h: torch.Tensor, rope: Rope, cache: PagedKvCache, meta: AttentionMetadata | DecodeMetadata,
                lora: LoraBatch | None = None) -> torch.Tensor:
        # Residual adds in place on the sublayers' fresh outputs (a + h == h + a bit for bit): one [T, hidden]
        # buffer fewer each, which on CPU spares large prefill chunks a page-faulted allocation.
        if self.layout == "pre":
            a = self.self_attn(self.input_layernorm(h), rope, cache, meta, lora)
            h = self._scaled(a).add_(h)
            return self._scaled(self.mlp(self.post_attention_layernorm(h), lora)).add_(h)
        a = self.self_attn(h if self.layout == "post" else self.input_layernorm(h), rope, cache, meta, lora)
        h = self.post_attention_layernorm(a).add_(h)
        m = self.mlp(h if self.layout == "post" else self.pre_feedforward_layernorm(h), lora)
        return self.post_feedforward_layernorm(m).add_(h)

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        # Granite's residual_multiplier: residual + out * m, as transformers computes it
        return out if self.residual_scale == 1.0 else out.mul_(self.residual_scale)


class DecoderModel(nn.Module):
    """Parameter names mirror HF's (`model.layers.N...`, `lm_head`) except the fused qkv_proj."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        # (the table given, not drawn: the loader builds the model on the meta device, where nn.Embedding's
        # random init goes through torch's reference kernels, whose first use imports torch._dynamo: ~2 s of
        # every executor start; the loader fills every weight anyway)
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                               _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.num_labels:  # a sequence classifier's head (its checkpoint's `score.weight`): see classify()
            self.score = Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        self.rotary: RotaryEmbedding | None = None  # the model's rope; set by the loader once the device is known
        self.layer_rotary: list[RotaryEmbedding | None] = []  # per layer (Gemma 3's local rope, NoPE layers)
        self.vision: nn.Module | None = None  # a vision-language model's vision tower (models/vision/; the loader
        # sets it): pixels -> embedding rows that replace the image placeholder tokens' embeddings (hidden's mm)
        self.weights_version = 0  # bumped whenever weights change in place (quantize): kernels holding raw
        # pointers to the weights (models/decode/native.py) rebuild their descriptors

    def init_rotary(self, device: torch.device) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device)
        local = (RotaryEmbedding(cfg.local_rope, cfg.head_dim, cfg.max_position_embeddings, device)
                 if cfg.local_rope is not None else None)
        self.layer_rotary = [None if cfg.rope_of(i) is None else local if cfg.rope_of(i) is cfg.local_rope
                             else self.rotary for i in range(cfg.num_layers)]

    def quantize(self, mode: str, force_dequant: bool = False) -> str | None:
        """Low-precision linear weights (models/quant/linear.py) for the float linear layers (those in blocks
        keep theirs); returns the kernel used, None for "none" or when no layer is float."""
        self.weights_version += 1
        with mappings_as_of_now():  # (it releases each weight's file pages: the weights, all loaded before)
            return quantize_linears(self, mode, lambda m: isinstance(m, Linear) and m.quant is None, force_dequant)

    def pack_cpu_weights(self) -> bool:
        """Pre-packs every linear weight for oneDNN (models/layers.py), in place of the plain weight: each
        Linear keeps a stand-in of the weight's shape and dtype (Linear.drop_plain_weight) and multiplies with
        the packed one at every size, and the plain weight's memory goes. A tied LM head stays plain: its
        weight is the embedding table. Only on CPU, float32, with mkldnn built in; a no-op elsewhere. Checks
        one packed product against F.linear first (the first layer packed, nothing dropped yet) and falls back
        (no packing) if the internal ops are missing or disagree. Returns whether the packed path is on."""
        embedding = self.model.embed_tokens.weight
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.weight is not embedding]
        weight = self.lm_head.weight
        if any(m.quant is not None for m in linears) or not linears:
            return False  # quantized weights have their own kernels
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return False
        try:
            with torch.no_grad():
                probe = linears[0]
                probe.packed = torch.ops.mkldnn._reorder_linear_weight(probe.weight.detach())
                x = torch.randn(3, probe.in_features, generator=torch.Generator().manual_seed(0))
                want = F.linear(x, probe.weight, probe.bias)
                if not torch.allclose(probe(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                    raise RuntimeError("packed linear disagrees with F.linear")
        except (RuntimeError, AttributeError):  # op missing in this torch build, or wrong numbers
            probe.packed = None
            return False
        with torch.no_grad():
            for m in linears:  # one at a time: at most one plain weight beside the packed ones
                if m.packed is None:
                    m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
                m.drop_plain_weight()
        self.weights_version += 1
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
                logit_rows: torch.Tensor | None, lora: LoraBatch | None = None,
                mm: MultimodalRows | None = None, mrope: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: [T]; logit_rows: [R] indices into the packed tokens whose logits are wanted (None: all,
        R = T). Returns float32 logits [R, vocab]; the LM head runs on those R rows only."""
        return self.project(self.hidden(input_ids, meta, cache, logit_rows, lora, mm, mrope))

    def hidden(self, input_ids: torch.Tensor, meta: AttentionMetadata | DecodeMetadata, cache: PagedKvCache,
               rows: torch.Tensor | None, lora: LoraBatch | None = None,
               mm: MultimodalRows | None = None, mrope: torch.Tensor | None = None) -> torch.Tensor:
        """The final (normed) hidden states of the rows asked for: [R, hidden], the LM head's input. A caller
        that needs many rows' logits (prompt logprobs) projects them in slices (project) instead of at once.
        mm: (packed rows [M], embedding rows [M, hidden]) that replace those tokens' embeddings (images).
        mrope: an M-RoPE model's rotary positions [3, T] (config.mrope_section; meta.positions stay the
        sequence positions the cache and the mask use)."""
        cfg = self.config
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        if cfg.embed_scale != 1.0:  # Gemma: sqrt(hidden); Granite: embedding_multiplier (in the model's dtype)
            h = h * torch.tensor(cfg.embed_scale, dtype=h.dtype)
        if mm is not None:  # image placeholders take the vision tower's rows (transformers' inputs_merger)
            h[mm[0]] = mm[1].to(h.dtype)
        ropes = {id(r): r.cos_sin(meta.positions, h.dtype) if mrope is None else
                 r.cos_sin_mrope(mrope, cfg.mrope_section, h.dtype) for r in self.layer_rotary if r is not None}
        for layer, rotary in zip(self.model.layers, self.layer_rotary):
            h = layer(h, None if rotary is None else ropes[id(rotary)], cache, meta, lora)
        return self.model.norm(h if rows is None else h[rows])  # [R, hidden]

    def classify(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [R, hidden] -> float32 classification head outputs [R, num_labels] (a
        *ForSequenceClassification checkpoint's `score` layer, read at the last position)."""
        return self.score(h).float()

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [R, hidden] -> float32 logits [R, vocab] (LM head, scaling, soft-capping)."""
        cfg = self.config
        logits = self.lm_head(h)  # [R, vocab]
        if cfg.logits_divisor != 1.0:  # Granite's logits_scaling
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.float()
