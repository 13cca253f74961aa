"""Attention for an all-decode batch (every item adds one token), in a form `torch.compile` traces into one
graph for every decode step (models/decode/compiled.py).

`DecodeMetadata` holds only tensors whose shapes are the batch size B and the block-table width W, so one
compiled graph (dynamic in B and W) serves every decode step:
  positions / slot_mapping / context_lens: [B]; block_tables: [B, W] (padded with block 0, masked out).

The KV write is the custom op `tandem::write_kv`, an in-place `index_copy_` the compiler sees as opaque.
Written as an indexed assignment inside the graph, or as an op declaring its mutation, the compiler
functionalises the pool: a copy of the whole KV pool per layer per step (measured: 1.6 s per SmolLM2 step).
So the op declares no mutation and returns a zero "ticket" that the pool's reads add to the block table
they gather through: that data dependency orders every read of a layer's pool after its write. The pools are passed
as per-layer views (not the [layers, ...] base indexed by layer), so every layer runs the same generated
kernels on other pointers rather than one copy of each kernel per layer offset (30x the compile time).

Attention gathers the context through the block table and makes one SDPA call (GQA folded into the query
axis). Reading K/V through the table inside the compiler's own loops (no gathered copy; softmax and both
products written as broadcast sums) was tried and measured: inductor's CPU loops with indirect indexing are
not vectorised, and a SmolLM2 step at batch 32 took 1.7x longer than with the gather + SDPA.
"""
from __future__ import annotations

import torch

from models.attention.spec import AttentionSpec, attend
from models.kv.paged_cache import PagedKvCache
from models.kv.dtype import load_kv, store_kv


@torch.library.custom_op("tandem::write_kv", mutates_args=())
def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor:
    """k_pool, v_pool: one layer's [blocks, block_size, kv_heads, d]; k, v: [T, kv_heads, d] written at the flat
    slots slot_mapping [T]. Returns a 0-d int64 zero, the ticket the reads of the pool take as an input (see
    the module docstring)."""
    store_kv(k_pool, slot_mapping, k)  # converted to the pool's dtype (--kv-dtype, models/kv/dtype.py)
    store_kv(v_pool, slot_mapping, v)
    return slot_mapping.new_zeros(())


@write_kv.register_fake
def _write_kv_fake(k_pool, v_pool, slot_mapping, k, v) -> torch.Tensor:
    return slot_mapping.new_empty(())


class DecodeMetadata:
    """What attention needs for one all-decode batch (see the module docstring for shapes)."""

    def __init__(self, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, k_pools: tuple[torch.Tensor, ...], v_pools: tuple[torch.Tensor, ...]
                 ) -> None:
        self.positions = positions  # [B] position of each item's new token
        self.slot_mapping = slot_mapping  # [B] flat KV slot it is written to
        self.block_tables = block_tables  # [B, W] int64
        self.context_lens = context_lens  # [B] keys each row attends to (its new token included)
        self.k_pools, self.v_pools = k_pools, v_pools  # per layer [blocks, block_size, kv_heads, d] (views)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKvCache, layer: int,
               spec: AttentionSpec, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [B, heads, d]; k, v: [B, kv_heads, d]. Writes k/v, returns [B, heads * d]."""
        k_pool, v_pool = self.k_pools[layer], self.v_pools[layer]
        ticket = write_kv(k_pool, v_pool, self.slot_mapping, k, v)
        return attend_gathered(q, k_pool, v_pool, self.block_tables + ticket, self.context_lens, spec, sinks)


def attend_gathered(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor, spec: AttentionSpec | float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, heads, d]; pools: [blocks, bs, kv_heads, d]; tables: [B, W]; lens: [B] -> [B, heads * d].
    spec: the layer's (a float: a plain scale). A sliding-window spec hides keys at or before
    lens - 1 - window (models/attention/spec.py)."""
    if not isinstance(spec, AttentionSpec):
        spec = AttentionSpec(float(spec))
    rows, heads, d = q.shape
    kv_heads = k_pool.shape[2]
    flat = tables.reshape(-1)
    # [B, kv_heads, L, d], in q's dtype whatever the pool's (--kv-dtype)
    keys = load_kv(k_pool.index_select(0, flat), q.dtype).view(rows, -1, kv_heads, d).transpose(1, 2)
    values = load_kv(v_pool.index_select(0, flat), q.dtype).view(rows, -1, kv_heads, d).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=q.device)[None, :]
    visible = positions < lens[:, None]  # [B, L]
    if spec.window is not None:
        visible = visible & (positions >= lens[:, None] - spec.window)
    out = attend(q.view(rows, kv_heads, heads // kv_heads, d), keys, values, visible[:, None, None, :], spec, sinks)
    return out.reshape(rows, heads * d)
