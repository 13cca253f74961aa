"""The layers of a tensor-parallel shard (models/parallel/shard.py makes them): each is the plain layer over
its rank's slice of the weight plus the one collective that makes its output whole.

- RowParallelLinear (o_proj, down_proj): the input's columns are split by rank, so each rank's product is a
  partial sum; one all_reduce adds them (the bias is added on rank 0 only, once).
- VocabParallelEmbedding: each rank holds a slice of the vocabulary's rows; ids outside it read zeros; one
  all_reduce gives every rank the whole embedding (exact: one rank's row plus zeros). VocabParallelBlockEmbedding
  is the same over a table in GGUF blocks (models/quant/blocks.py).
- VocabParallelHead: each rank scores its slice of the vocabulary; the slices are gathered on rank 0, which
  alone samples (the workers' outputs are their own slices, unused).
- ExpertParallelMoe: each rank holds a contiguous range of the experts; every rank routes every token (the
  router is replicated), runs only the assignments to its experts, and one all_reduce adds the ranks' parts.

Column-parallel layers (q/k/v, gate, up) need no class: their output is the rank's heads or its slice of the
intermediate size, consumed locally by attention or the activation.

Collectives run on the group the ranks share (torch.distributed; gloo on CPU, NCCL on CUDA). They run under
torch.inference_mode like everything else in the forward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.layers import Linear
from models.lora.batch import LoraBatch
from models.moe import SparseMoeBlock
from models.quant.blocks import BlockWeight, stand_in


class RowParallelLinear(Linear):
    """A Linear whose weight holds this rank's input columns; the output is all-reduced (summed)."""

    group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # [T, out] partial
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + weight.shape[0]) of the embedding table."""

    def __init__(self, weight: torch.Tensor, first: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.first = first
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        h.masked_fill_(outside[:, None], 0)
        dist.all_reduce(h, group=self.group)
        return h


class VocabParallelBlockEmbedding(nn.Module):
    """Rows [first, first + blocks.out_features) of an embedding table in blocks; `weight` a stand-in of the
    slice's shape in the model's dtype, `blocks` the slice (a tied head multiplies with it)."""

    def __init__(self, blocks: BlockWeight, first: int, dtype: torch.dtype, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.blocks, self.first, self.group = blocks, first, group
        self.weight = stand_in((blocks.out_features, blocks.in_features), dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.blocks.out_features)
        h = self.blocks.rows(local.masked_fill(outside, 0)).to(self.weight.dtype)  # [T, hidden]
        h.masked_fill_(outside[:, None], 0)
        dist.all_reduce(h, group=self.group)
        return h


class VocabParallelHead(Linear):
    """The LM head over vocabulary rows [first, first + out_features); `shard` columns per rank (the last
    rank's slice may be shorter: padded for the gather). Rank 0 returns [R, vocab]; the others their slice."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    world: int = 1
    shard: int = 0
    vocab: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # [R, out_features]
        if y.shape[1] < self.shard:
            y = F.pad(y, (0, self.shard - y.shape[1]))
        y = y.contiguous()
        if self.rank != 0:
            dist.gather(y, None, dst=0, group=self.group)
            return y
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.gather(y, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=1)[:, :self.vocab]


class ExpertParallelMoe(SparseMoeBlock):
    """A SparseMoeBlock holding experts [first_expert, first_expert + num_experts) of total_experts."""

    group: dist.ProcessGroup | None = None
    first_expert: int = 0
    total_experts: int = 0

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        weights, experts = self.route(x)  # over every expert: the router is replicated
        flat = experts.reshape(-1)  # [T*k]
        self.expert_tokens += torch.bincount(flat, minlength=self.total_experts)  # the whole model's counts
        local = flat - self.first_expert
        mine = ((local >= 0) & (local < self.num_experts)).nonzero().squeeze(1)  # this rank's assignments
        order = mine[torch.argsort(local[mine], stable=True)]
        counts = torch.bincount(local[mine], minlength=self.num_experts)  # [E_local]
        token_of = order // self.top_k
        weight_of = weights.reshape(-1)[order]
        out = self.run_experts(x, counts, token_of, weight_of, local[order])
        dist.all_reduce(out, group=self.group)
        return out
