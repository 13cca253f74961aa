"""Tensor parallelism: a loaded DecoderModel cut in place down to one rank's shard, Megatron-style.

Per layer: q/k/v column-parallel (the rank's query heads and KV heads: its KV pool holds only those), o_proj
row-parallel (+ one all_reduce); gate/up column-parallel, down row-parallel (+ one all_reduce); MoE layers
split their experts by rank (+ one all_reduce). The embedding and the LM head are split by vocabulary rows
(an all_reduce; a gather of the logits to rank 0). Norms, rotary tables and the router stay whole on every
rank. The layers that do the collectives are in models/parallel/layers.py.

What cannot be split evenly is refused (`shard_refusal`), with the reason: heads and KV heads must divide by
the group's size (no KV-head replication), and so must the MLP's intermediate size and the expert count.
Weights kept in GGUF block formats (models/quant/blocks.py) are cut as bytes: column-parallel layers by rows
(each row is whole blocks), row-parallel ones by columns, which must fall on block boundaries (a rank's share of
o_proj's and down_proj's inputs a multiple of 32, or 256 for the K-quants; else refused, naming
--gguf-dequantize), the embedding and head by vocabulary rows.

Each slice is a fresh copy; the whole tensor it came from is dropped (its file pages released when it was a
view of the mapped checkpoint), so a rank keeps about 1/N of the weights (the norms and the router whole).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from models.config import ModelConfig
from models.layers import MLP, Attention, Linear
from models.memory.mapped_pages import release_file_pages
from models.moe import SparseMoeBlock
from models.quant.blocks import BlockWeight, QuantEmbedding, stand_in
from models.parallel.layers import (ExpertParallelMoe, RowParallelLinear, VocabParallelBlockEmbedding,
                                   VocabParallelEmbedding, VocabParallelHead)
from models.transformer import DecoderModel
from tandem.ceil_div import ceil_div


@dataclass(frozen=True)
class Shard:
    """Which part of the model this process holds: rank `rank` of `size`, collectives on `group`."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None: the default process group

    def span(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of `total` items split evenly (total divisible by size)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per


def shard_refusal(cfg: ModelConfig, size: int) -> str | None:
    """Why this model cannot be split over `size` ranks (None: it can)."""
    if size < 1:
        return f"--tensor-parallel-size must be at least 1, got {size}"
    if cfg.num_heads % size or cfg.num_kv_heads % size:
        return (f"{cfg.num_heads} attention heads and {cfg.num_kv_heads} KV heads do not both divide by "
                f"--tensor-parallel-size {size} (each rank holds whole heads; KV heads are not replicated)")
    if cfg.qk_norm_whole:
        return "q/k norms over the whole projection (OLMo 2) are not split by rank yet"
    if cfg.quantized_experts:
        return f"{cfg.quantized_experts} experts are not split by rank yet"
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if dense and cfg.intermediate_size % size:
        return f"the MLP's intermediate size {cfg.intermediate_size} does not divide by {size}"
    if len(dense) < cfg.num_layers and cfg.num_experts % size:
        return f"{cfg.num_experts} experts do not divide by --tensor-parallel-size {size}"
    return None


def shard_model(model: DecoderModel, shard: Shard, layers_cut: bool = False) -> None:
    """Cuts `model` (as loaded: before quantizing, packing or huge pages) down to `shard`'s part, in place
    (layers_cut: its decoder layers were cut while loading, shard_layer). Raises ValueError when the model
    cannot be split that way."""
    why = shard_refusal(model.config, shard.size) or _block_refusal(model, shard.size)
    if why:
        raise ValueError(f"tensor parallelism: {why}")
    with torch.no_grad():
        for layer in model.model.layers if not layers_cut else ():
            shard_layer(layer, shard)
        _vocab(model, shard)
    model.weights_version += 1


def shard_layer(layer: nn.Module, shard: Shard) -> None:
    """Cuts one decoder layer down to `shard`'s part, in place (models/loader.py's on_layer calls it as each
    layer is loaded; shard_model for a model loaded whole)."""
    with torch.no_grad():
        _attention(layer.self_attn, shard)
        if isinstance(layer.mlp, SparseMoeBlock):
            _experts(layer.mlp, shard)
        else:
            _mlp(layer.mlp, shard)


def _block_refusal(model: DecoderModel, size: int) -> str | None:
    """Why a row-parallel layer in blocks cannot be cut by `size` on block boundaries (None: it can)."""
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_proj, getattr(layer.mlp, "down_proj", None)):
            q = getattr(proj, "quant", None)
            if isinstance(q, BlockWeight) and (q.in_features // size) % q.widest_block():
                return (f"a rank's {q.in_features // size} of the {q.in_features} inputs of a layer in {'+'.join(q.formats)} "
                        f"blocks of {q.widest_block()} weights would cut blocks; pass --gguf-dequantize to load the "
                        "file as float")
    return None


def _cut_blocks(proj: Linear, rows: torch.Tensor | None = None, columns: tuple[int, int] | None = None) -> None:
    """A Linear in blocks cut to `rows` (column-parallel) or `columns` [first, end) (row-parallel), after its
    bias was cut: the cut blocks are copies, the whole ones' file pages go; `weight` a stand-in of the shape."""
    q = proj.quant
    cut = q.select_rows(rows, proj.bias) if rows is not None else q.select_columns(*columns, proj.bias)
    release_file_pages([b for _, b in q.parts])
    proj.quant = cut
    proj.weight = stand_in((cut.out_features, cut.in_features), proj.weight.dtype, proj.weight.device)


def _take(module: nn.Module, name: str, piece: torch.Tensor | None) -> None:
    """Replaces parameter `name` by a copy of `piece` (None: no parameter) and gives back the whole one."""
    old = getattr(module, name)
    new = None if piece is None else nn.Parameter(piece.contiguous().clone(), requires_grad=False)
    setattr(module, name, new)
    if old is not None:
        release_file_pages([old.detach()])


def _attention(attn: Attention, shard: Shard) -> None:
    d = attn.head_dim
    q0, q1 = shard.span(attn.heads)
    k0, k1 = shard.span(attn.kv_heads)
    q_size, kv_size = attn.q_size, attn.kv_size
    rows = torch.cat([torch.arange(q0 * d, q1 * d), q_size + torch.arange(k0 * d, k1 * d),
                      q_size + kv_size + torch.arange(k0 * d, k1 * d)])
    qkv = attn.qkv_proj
    if qkv.bias is not None:
        _take(qkv, "bias", qkv.bias.index_select(0, rows.to(qkv.bias.device)))
    if isinstance(qkv.quant, BlockWeight):
        _cut_blocks(qkv, rows=rows)
    else:
        _take(qkv, "weight", qkv.weight.index_select(0, rows.to(qkv.weight.device)))
    qkv.out_features = len(rows)
    attn.heads, attn.kv_heads = q1 - q0, k1 - k0
    attn.q_size, attn.kv_size = attn.heads * d, attn.kv_heads * d
    if attn.sinks is not None:
        _take(attn, "sinks", attn.sinks[q0:q1])
    _row_parallel(attn.o_proj, q0 * d, q1 * d, shard)


def _mlp(mlp: MLP, shard: Shard) -> None:
    i0, i1 = shard.span(mlp.gate_proj.out_features)
    for proj in (mlp.gate_proj, mlp.up_proj):
        if proj.bias is not None:
            _take(proj, "bias", proj.bias[i0:i1])
        if isinstance(proj.quant, BlockWeight):
            _cut_blocks(proj, rows=torch.arange(i0, i1))
        else:
            _take(proj, "weight", proj.weight[i0:i1])
        proj.out_features = i1 - i0
    _row_parallel(mlp.down_proj, i0, i1, shard)


def _row_parallel(proj: Linear, c0: int, c1: int, shard: Shard) -> None:
    if proj.bias is not None and shard.rank != 0:  # added once, on rank 0, before the sum
        _take(proj, "bias", None)
    if isinstance(proj.quant, BlockWeight):
        _cut_blocks(proj, columns=(c0, c1))
    else:
        _take(proj, "weight", proj.weight[:, c0:c1])
    proj.in_features = c1 - c0
    proj.__class__ = RowParallelLinear
    proj.group = shard.group


def _experts(moe: SparseMoeBlock, shard: Shard) -> None:
    e0, e1 = shard.span(moe.num_experts)
    for name in ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias"):
        if getattr(moe, name, None) is not None:
            _take(moe, name, getattr(moe, name)[e0:e1])
    moe.__class__ = ExpertParallelMoe
    moe.total_experts, moe.first_expert, moe.num_experts = moe.num_experts, e0, e1 - e0
    moe.group = shard.group


def _vocab(model: DecoderModel, shard: Shard) -> None:
    vocab = model.config.vocab_size
    per = ceil_div(vocab, shard.size)
    v0, v1 = min(vocab, shard.rank * per), min(vocab, (shard.rank + 1) * per)
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight
    head = model.lm_head
    if head.bias is not None:
        _take(head, "bias", head.bias[v0:v1])
    if isinstance(embed, QuantEmbedding):
        table = embed.blocks.select_rows(torch.arange(v0, v1), None)
        sharded = VocabParallelBlockEmbedding(table, v0, embed.weight.dtype, shard.group)
        release_file_pages([b for _, b in embed.blocks.parts])
    else:
        sharded = VocabParallelEmbedding(embed.weight[v0:v1].clone(), v0, shard.group)
        release_file_pages([embed.weight.detach()])
    if tied:
        head.weight = sharded.weight
        if isinstance(embed, QuantEmbedding):  # the head multiplies with the shard's own rows
            head.quant = sharded.blocks
    elif isinstance(head.quant, BlockWeight):
        _cut_blocks(head, rows=torch.arange(v0, v1))
    else:
        _take(head, "weight", head.weight[v0:v1])
    model.model.embed_tokens = sharded
    head.out_features = v1 - v0
    head.__class__ = VocabParallelHead
    head.group, head.rank, head.world, head.shard, head.vocab = shard.group, shard.rank, shard.size, per, vocab
