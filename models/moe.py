"""The sparse MoE MLP of Qwen3-MoE, Mixtral and GPT-OSS: a router picks top-k experts per token; tokens are
dispatched in one batch.

Routers as transformers defines them:
- qwen (Qwen3-MoE, Mixtral): logits = x @ W_gate^T, softmax in float32, top-k, optional renormalisation of the
  k probabilities (norm_topk_prob; Mixtral always), cast back to the activations' dtype;
- gpt_oss: logits = x @ W_gate^T + b, top-k of the logits, softmax over those k.
Experts: SwiGLU, down(silu(gate) * up); gpt_oss adds biases to both projections and clamps: gate to at most
`limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).

Dispatch over the whole packed batch (every item's tokens together): the T*k (token, expert) assignments
are sorted by expert, bincount gives each expert's segment, each expert's gate_up and down matmuls run
over its segment — all experts in one `torch._grouped_mm` per projection where torch has it, else a
Python loop over active experts (never over tokens) — and the results, scaled by the routing weights,
are scattered back with index_add_. Expert weights are stacked once at load: gate_up [E, 2*I, H] (gate
rows first), down [E, H, I] (biases [E, 2*I], [E, H]).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.lora.batch import LoraBatch


class SparseMoeBlock(nn.Module):
    # torch._grouped_mm (private, torch >= 2.8) when present; switched off for good if it ever refuses.
    grouped: bool = hasattr(torch, "_grouped_mm")

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gpt_oss = cfg.moe_style == "gpt_oss"
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        inter = cfg.moe_intermediate_size
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=self.gpt_oss)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(cfg.num_experts, 2 * inter, cfg.hidden_size))
        self.experts_down = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, inter))
        if self.gpt_oss:
            self.experts_gate_up_bias = nn.Parameter(torch.empty(cfg.num_experts, 2 * inter))
            self.experts_down_bias = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.inter = inter
        # Tokens routed to each expert since load (load balance, GetMetrics); on the weights' device.
        self.register_buffer("expert_tokens", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k] in x's dtype, experts [T, k])."""
        logits = self.gate(x)  # [T, E]
        if self.gpt_oss:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return F.softmax(top, dim=1, dtype=top.dtype), experts
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        # lora: accepted for the dense MLP's signature; adapters never reach experts (refused at load)
        # x: [T, H]
        weights, experts = self.route(x)
        flat_experts = experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat_experts, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat_experts, minlength=self.num_experts)  # [E]
        self.expert_tokens += counts
        token_of = order // self.top_k  # [T*k] token row of each sorted assignment
        weight_of = weights.reshape(-1)[order]  # [T*k]
        return self.run_experts(x, counts, token_of, weight_of, flat_experts[order])

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor, token_of: torch.Tensor, weight_of: torch.Tensor,
                    sorted_experts: torch.Tensor) -> torch.Tensor:
        """The assignments, grouped by expert (counts [E] per expert; token row token_of, routing weight
        weight_of and expert sorted_experts of each, [A]), through their experts, summed per token: [T, H]."""
        out = torch.zeros_like(x)
        if self.grouped:
            try:
                return self._grouped(x, out, counts, token_of, weight_of, sorted_experts)
            except RuntimeError:  # this build/device/dtype lacks it: the loop below from now on
                SparseMoeBlock.grouped = False
                out.zero_()
        start = 0
        for e, n in enumerate(counts.tolist()):  # active experts only do work
            if n == 0:
                continue
            rows = token_of[start:start + n]
            gate_up = F.linear(x.index_select(0, rows), self.experts_gate_up[e],
                               self.experts_gate_up_bias[e] if self.gpt_oss else None)
            y = F.linear(self._act(gate_up), self.experts_down[e],
                         self.experts_down_bias[e] if self.gpt_oss else None)  # [n, H]
            out.index_add_(0, rows, y * weight_of[start:start + n, None])
            start += n
        return out

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [n, 2I] (gate columns first) -> [n, I]."""
        gate, up = gate_up.split(self.inter, dim=-1)
        if not self.gpt_oss:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _grouped(self, x: torch.Tensor, out: torch.Tensor, counts: torch.Tensor, token_of: torch.Tensor,
                 weight_of: torch.Tensor, expert_of: torch.Tensor) -> torch.Tensor:
        # One grouped matmul per projection over all experts' segments (offs = segment ends), as
        # transformers' grouped_mm experts path: ~2x the per-expert loop at 8-32 decode tokens on CPU.
        offs = counts.cumsum(0).to(torch.int32)  # [E]
        xs = x.index_select(0, token_of)  # [T*k, H], grouped by expert
        gate_up = torch._grouped_mm(xs, self.experts_gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
        if self.gpt_oss:
            gate_up = gate_up + self.experts_gate_up_bias.index_select(0, expert_of)
        y = torch._grouped_mm(self._act(gate_up), self.experts_down.transpose(1, 2), offs=offs)  # [T*k, H]
        if self.gpt_oss:
            y = y + self.experts_down_bias.index_select(0, expert_of)
        return out.index_add_(0, token_of, y * weight_of[:, None])
