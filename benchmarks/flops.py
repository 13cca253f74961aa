"""FLOPs of forward passes from a model's shapes: 2 x the decoder layers' linear weights per processed token (the
embedding lookup is free), 2 x hidden x vocab per LM-head row, attention 4 x head_dim x heads per (query, key)
pair per layer."""
from __future__ import annotations

from typing import Any

import torch


class FlopModel:
    """Matmul FLOPs of forwards over one model (from_executor: the loaded model's linear weights; from_config:
    config.json's shapes, for a model another process serves)."""

    def __init__(self, layers: int, heads: int, head_dim: int, vocab: int, layer_params: int,
                 lm_head_params: int) -> None:
        self.layers, self.heads, self.head_dim, self.vocab = layers, heads, head_dim, vocab
        self.layer_params = layer_params  # linear weights of all decoder layers together
        self.lm_head_params = lm_head_params

    @classmethod
    def from_executor(cls, ex: Any) -> "FlopModel":
        """ex: an in-process Executor (every nn.Linear of its decoder layers: fused qkv / gate_up included; packed
        MoE expert weights are no nn.Linear, so a MoE model's experts are not counted)."""
        cfg = ex.model_config
        params = sum(m.weight.numel() for m in ex.model.model.layers.modules() if isinstance(m, torch.nn.Linear))
        return cls(cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.vocab_size, params, ex.model.lm_head.weight.numel())

    @classmethod
    def from_config(cls, cfg: Any) -> "FlopModel":
        """cfg: a dense model's ModelConfig (q, k, v, o, gate, up, down projections)."""
        h = cfg.hidden_size
        per_layer = 2 * h * cfg.q_size + 2 * h * cfg.kv_size + 3 * h * cfg.intermediate_size
        return cls(cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.vocab_size, cfg.num_layers * per_layer,
                   h * cfg.vocab_size)

    def linear(self, tokens: float) -> float:
        return 2.0 * self.layer_params * tokens

    def lm_head(self, rows: int) -> float:
        return 2.0 * self.lm_head_params * rows

    def attention(self, keys_summed: float) -> float:
        """keys_summed: sum over the batch's query tokens of the keys each attends to."""
        return 4.0 * keys_summed * self.head_dim * self.heads * self.layers

    def decode_step(self, batch: int, keys: float) -> float:
        return self.linear(batch) + self.lm_head(batch) + self.attention(batch * keys)

    def prefill(self, batch: int, length: int, lm_rows: int) -> float:
        return self.linear(batch * length) + self.lm_head(lm_rows) + self.attention(batch * length * (length + 1) // 2)

    def request(self, prompt: int, output: int) -> float:
        """One generation request's useful work: forwards over prompt + output - 1 tokens (the last sampled token
        is never fed back), causal attention, the LM head once per output token."""
        processed = prompt + output - 1
        return self.linear(processed) + self.lm_head(output) + self.attention(processed * (processed + 1) // 2)
