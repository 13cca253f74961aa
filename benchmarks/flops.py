"""FLOP accounting of forward passes, from a model's shapes: 2 x the decoder layers' linear weights per
processed token (the embedding lookup is free), 2 x hidden x vocab per LM-head row, and attention 4 x
head_dim x heads per (query, key) pair per layer."""
from __future__ import annotations

from typing import Any

import torch


class FlopModel:
    """Matmul FLOPs of forwards over one model (from_executor: the loaded model's linear weights;
    from_config: config.json's shapes, for a model served by another process)."""

    def __init__(self, layers: int, heads: int, head_dim: int, hidden: int, vocab: int, layer_params: int,
                 lm_head_params: int) -> None:
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.hidden, self.vocab = hidden, vocab
        self.layer_params = layer_params  # linear weights of all decoder layers together
        self.lm_head_params = lm_head_params

    @classmethod
    def from_executor(cls, ex: Any) -> "FlopModel":
        """ex: an in-process Executor. Every linear weight of its decoder layers (fused qkv / gate_up included;
        norms are elementwise)."""
        cfg = ex.model_config
        layer_params = sum(m.weight.numel() for m in ex.model.model.layers.modules()
                           if isinstance(m, torch.nn.Linear))
        return cls(cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.vocab_size, layer_params,
                   ex.model.lm_head.weight.numel())

    @classmethod
    def from_config(cls, cfg: Any) -> "FlopModel":
        """cfg: a dense model's ModelConfig (q, k, v, o, gate, up, down projections)."""
        h = cfg.hidden_size
        attn = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h
        mlp = 3 * h * cfg.intermediate_size
        return cls(cfg.num_layers, cfg.num_heads, cfg.head_dim, h, cfg.vocab_size, cfg.num_layers * (attn + mlp),
                   h * cfg.vocab_size)

    def linear(self, tokens: float) -> float:
        return 2.0 * self.layer_params * tokens

    def lm_head(self, rows: int) -> float:
        return 2.0 * self.lm_head_params * rows

    def attention(self, keys_summed: float) -> float:
        """keys_summed: sum over the batch's query tokens of the keys each one attends to."""
        return 4.0 * keys_summed * self.head_dim * self.heads * self.layers

    def decode_step(self, batch: int, keys: float, lm_rows: int | None = None) -> float:
        return self.linear(batch) + self.lm_head(batch if lm_rows is None else lm_rows) + \
            self.attention(batch * keys)

    def prefill(self, batch: int, length: int, lm_rows: int) -> float:
        causal = length * (length + 1) // 2
        return self.linear(batch * length) + self.lm_head(lm_rows) + self.attention(batch * causal)

    def request(self, prompt: int, output: int) -> dict[str, float]:
        """The useful work of one generation request: the forwards process prompt + output - 1 tokens (the
        last sampled token is never fed back), the LM head runs once per output token, attention is causal."""
        processed = prompt + output - 1
        # query at position q (0-based) attends q + 1 keys: positions 0 .. prompt + output - 2 are processed
        pairs = processed * (processed + 1) // 2
        linear, lm_head, attention = self.linear(processed), self.lm_head(output), self.attention(pairs)
        return {"linear": linear, "lm_head": lm_head, "attention": attention,
                "total": linear + lm_head + attention}

    def as_dict(self) -> dict[str, Any]:
        return {"decoder_linear_weights": self.layer_params, "lm_head_weights": self.lm_head_params,
                "layers": self.layers, "heads": self.heads, "head_dim": self.head_dim}


class MoeFlopModel(FlopModel):
    """FlopModel with the experts a token is routed to added to the per-token weights (from_executor counts
    nn.Linear only: the dense MLPs, attention and the routers, not packed expert weights)."""

    @classmethod
    def from_executor(cls, ex: Any) -> "FlopModel":
        flops = super().from_executor(ex)
        cfg = ex.model_config
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        flops.layer_params += moe_layers * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        return flops
