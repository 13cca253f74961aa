"""Paged attention through PyTorch's FlexAttention, reading K/V where they lie in the pool (no gathered copy).

The same contract as models/attention/paged.py (`AttentionMetadata`: a packed batch of items, each `n_new` tokens
after `past` cached ones), computed the way PyTorch's paged-attention recipe does it
(torch/nn/attention/experimental/_paged_attention.py):

- the key/value axis is the whole pool of one layer, `[1, kv_heads, pool_blocks * block_size, d]`, a strided
  view of `[blocks, block_size, kv_heads, d]` (no copy);
- a `BlockMask` whose key blocks are the pool's blocks (its KV block size is the cache's block size) lists, for
  each item row, the physical blocks of that item's block table: the kernel visits those blocks only;
- its mask_mod maps a physical key index back to the item's logical position (a `[rows, pool_blocks]`
  physical -> logical table, -1 where the item holds no such block, and for the sliding-window null block)
  and applies causality (and the window) there.

Items are split into a decode bucket (one new token each) and a prefill bucket (queries padded to the longest
chunk: prefill, chunked prefill after a prefix hit, speculative verify), as in models/attention/paged.py. Per
layer and bucket: one `flex_attention` call, grouped-query heads through `enable_gqa`. Soft-capping is the
score_mod; sinks (GPT-OSS) rescale the output by sigmoid(lse - sink), the share the sink's extra softmax
term leaves to the keys (flex returns the row's logsumexp). On CPU, compiled flex (torch 2.13) returns no
logsumexp and fails to compile the soft-cap score_mod: layers with either run flex's eager form there.

A KV pool in another dtype than the activations' (--kv-dtype, models/kv/dtype.py; `converted=True`): the
pool is not read in place. Each batch's blocks (the union of its items' tables, each block once) are gathered
and converted to the activations' dtype, and the BlockMask indexes that compact key axis instead of the pool.

Eager, flex_attention computes scores against every key of its key axis, i.e. the whole pool: a tested
reference on CPU (small pools), not a fast path. Compiled (`compiled=True`: inductor's flex templates, C++ on
CPU, Triton on CUDA) it visits the listed blocks only. models/attention/backend.py picks between this and
the gathered path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from models.attention.paged import ItemLayout, token_slots
from models.attention.spec import AttentionSpec
from models.kv.paged_cache import PagedKvCache
from models.kv.dtype import load_kv, store_kv
from tandem.ceil_div import ceil_div

Q_BLOCK = 128  # the BlockMask's query tile (every tile of one item row lists the same key blocks)

_compiled: Callable[..., object] | None = None


def compiled_flex() -> Callable[..., object]:
    """flex_attention under torch.compile, made once per process (dynamic shapes: one graph for every batch).
    On CPU (torch 2.13) inductor's C++ flex template compiles this module's masks at small head dims (the
    tests' tiny models) but emits C++ that does not compile at SmolLM2's (64 x 9 heads, a 512-token chunk):
    models/attention/backend.py runs flex eagerly on CPU unless asked (docs/cuda.md has the measurements)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=True)
    return _compiled


@dataclass
class _FlexBucket:
    token_index: torch.Tensor  # [n] positions of this bucket's tokens in the packed batch
    batch_index: torch.Tensor  # [n] item row within the bucket
    query_index: torch.Tensor  # [n] query slot within the item's padded chunk
    past: torch.Tensor  # [B] tokens cached before this step: query i sits at position past + i
    last: torch.Tensor  # [B] the item's last position (padded query rows see up to it)
    logical: torch.Tensor  # [B, pool_blocks] logical block index of each physical block, -1: not the item's
    kv_num_blocks: torch.Tensor  # [B, 1, q_tiles] int32
    kv_indices: torch.Tensor  # [B, 1, q_tiles, pool_blocks] int32: the item's physical blocks first
    max_q: int
    covers_batch: bool
    masks: dict[int | None, BlockMask] = field(default_factory=dict)  # window -> its BlockMask, made on first use


class FlexMetadata:
    """What FlexAttention needs for one packed batch, built once and shared by all layers."""

    def __init__(self, items: Sequence[ItemLayout], block_size: int, pool_blocks: int, device: torch.device,
                 null_block: int | None = None, compiled: bool = False, converted: bool = False) -> None:
        positions, slots = token_slots(items, block_size)
        self.num_tokens = int(sum(it.n_new for it in items))
        self.positions = torch.from_numpy(positions).to(device)  # [T]
        self.slot_mapping = torch.from_numpy(slots).to(device)  # [T]
        self.block_size, self.pool_blocks = block_size, pool_blocks
        self.flex = compiled_flex() if compiled else flex_attention
        # Triton's prefill kernel needs its key tile (BLOCK_N) to divide the BlockMask's key block, the cache's
        # block size (16 by default); its default tile for bf16 at head dim 64 is 64 and, as the only config,
        # fails to lower (seen on an H200, torch 2.11). The decode kernel shrinks its own tile already.
        on_cuda = torch.device(device).type == "cuda"
        self.kernel_options = {"BLOCK_N": math.gcd(block_size, 64)} if compiled and on_cuda else None
        # converted: the key axis is the batch's blocks gathered (`gather`, physical ids), each item's blocks
        # renamed to their index there
        self.gather: torch.Tensor | None = None
        if converted:
            used = np.unique(np.concatenate([np.asarray(it.blocks[:ceil_div(it.past + it.n_new, block_size)],
                                                        dtype=np.int64) for it in items]))
            rename = np.full(pool_blocks, -1, dtype=np.int64)
            rename[used] = np.arange(len(used))
            items = [ItemLayout(rename[np.asarray(it.blocks[:ceil_div(it.past + it.n_new, block_size)],
                                                  dtype=np.int64)].tolist(), it.past, it.n_new) for it in items]
            null_block = None if null_block is None or rename[null_block] < 0 else int(rename[null_block])
            self.pool_blocks = len(used)
            self.gather = torch.from_numpy(used).to(device)
        starts = np.cumsum([0] + [it.n_new for it in items])[:-1]
        decode = [i for i, it in enumerate(items) if it.n_new == 1]
        prefill = [i for i, it in enumerate(items) if it.n_new > 1]
        self.buckets = [self._bucket([items[i] for i in part], starts[part], device, null_block,
                                     len(part) == len(items)) for part in (decode, prefill) if part]

    def _bucket(self, items: list[ItemLayout], starts: np.ndarray, device: torch.device, null_block: int | None,
                covers_batch: bool) -> _FlexBucket:
        bs = self.block_size
        n_new = np.array([it.n_new for it in items], dtype=np.int64)
        past = np.array([it.past for it in items], dtype=np.int64)
        ctx = past + n_new
        max_q = int(n_new.max())
        used = [ceil_div(int(c), bs) for c in ctx]
        q_tiles = ceil_div(max_q, Q_BLOCK)
        logical = np.full((len(items), self.pool_blocks), -1, dtype=np.int64)
        # As wide as the pool: the compiled kernels take the BlockMask's width (in blocks) as the key axis' extent.
        indices = np.zeros((len(items), 1, q_tiles, self.pool_blocks), dtype=np.int32)
        counts = np.zeros((len(items), 1, q_tiles), dtype=np.int32)
        for row, (it, n) in enumerate(zip(items, used)):
            blocks = np.asarray(it.blocks[:n], dtype=np.int64)
            live = blocks if null_block is None else blocks[blocks != null_block]
            logical[row, blocks] = np.arange(n)
            if null_block is not None:
                logical[row, null_block] = -1  # repeated in the table; its keys are never visible
            indices[row, :, :, :len(live)] = live.astype(np.int32)
            counts[row] = len(live)
        batch_index = np.repeat(np.arange(len(items)), n_new)
        query_index = np.arange(int(n_new.sum())) - np.repeat(np.cumsum(n_new) - n_new, n_new)
        token_index = np.repeat(starts, n_new) + query_index
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        return _FlexBucket(t(token_index), t(batch_index), t(query_index), t(past), t(ctx - 1), t(logical), t(counts),
                           t(indices), max_q, covers_batch)

    def _mask(self, b: _FlexBucket, window: int | None) -> BlockMask:
        if window in b.masks:
            return b.masks[window]
        bs, logical, past, last = self.block_size, b.logical, b.past, b.last

        def mask_mod(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
                     ) -> torch.Tensor:
            block = logical[batch, kv_idx // bs]
            pos = block * bs + kv_idx % bs
            # Query i sits at position past + i; padded rows (i >= n_new) see the item's whole context (never
            # an all-masked row; their output is dropped). Arithmetic, not a [B, max_q] table indexed by q_idx:
            # inductor's CPU flex template miscompiles that gather once a chunk exceeds its query split (torch 2.13).
            query = torch.minimum(past[batch] + q_idx, last[batch])
            visible = (block >= 0) & (pos <= query)
            return visible if window is None else visible & (pos > query - window)

        # compute_q_blocks=False: the transposed (query-major) index serves the backward pass only.
        mask = BlockMask.from_kv_blocks(b.kv_num_blocks, b.kv_indices, BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
                                        seq_lengths=(b.max_q, self.pool_blocks * bs), compute_q_blocks=False)
        b.masks[window] = mask
        return mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKvCache, layer: int,
               spec: AttentionSpec, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d]: writes k/v into the pool, attends -> [T, heads * d]."""
        total, heads, d = q.shape
        kv_heads = k.shape[1]
        k_pool, v_pool = cache.k[layer], cache.v[layer]  # [pool_blocks, block_size, kv_heads, d]
        store_kv(k_pool, self.slot_mapping, k)  # converted to the pool's dtype (--kv-dtype, models/kv/dtype.py)
        store_kv(v_pool, self.slot_mapping, v)
        if self.gather is not None:  # the batch's blocks, converted to q's dtype
            k_pool, v_pool = (load_kv(p.index_select(0, self.gather), q.dtype) for p in (k_pool, v_pool))
        keys = k_pool.view(1, -1, kv_heads, d).transpose(1, 2)  # [1, kv_heads, pool_blocks * block_size, d]
        values = v_pool.view(1, -1, kv_heads, d).transpose(1, 2)
        out = q.new_empty(total, heads, d)
        for b in self.buckets:
            rows = b.past.shape[0]
            if b.max_q == 1:
                qb = (q if b.covers_batch else q[b.token_index]).view(rows, heads, 1, d)
            else:
                padded = q.new_zeros(rows, b.max_q, heads, d)
                padded[b.batch_index, b.query_index] = q[b.token_index]
                qb = padded.transpose(1, 2)  # [B, heads, max_q, d]
            ob = _flex(self.flex, qb, keys, values, self._mask(b, spec.window), spec, sinks,
                       self.kernel_options)  # [B, heads, max_q, d]
            if b.max_q == 1 and b.covers_batch:
                return ob.reshape(total, heads * d)
            ob = ob.transpose(1, 2)  # [B, max_q, heads, d]
            out[b.token_index] = ob.reshape(rows, heads, d) if b.max_q == 1 else ob[b.batch_index, b.query_index]
        return out.view(total, heads * d)


def _flex(flex: Callable[..., object], q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: BlockMask,
          spec: AttentionSpec, sinks: torch.Tensor | None, kernel_options: dict[str, int] | None = None
          ) -> torch.Tensor:
    """One flex_attention call with the layer's soft cap and sinks: q [B, heads, Q, d] -> [B, heads, Q, d]."""
    score_mod = None
    if spec.softcap is not None:
        cap = torch.tensor(spec.softcap, dtype=q.dtype, device=q.device)  # a tensor: a float closure would be
        # a symbolic float under dynamic shapes, which inductor's flex template cannot lower (torch 2.13)

        def score_mod(score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                      kv_idx: torch.Tensor) -> torch.Tensor:
            return torch.tanh(score / cap) * cap

    if q.device.type == "cpu" and (score_mod is not None or sinks is not None):
        # torch 2.13's CPU flex template returns no logsumexp, and its C++ for this score_mod under dynamic
        # shapes does not compile (an undeclared split size): these layers take the eager form there.
        flex = flex_attention
    group = q.shape[1] // keys.shape[1]
    if sinks is None:
        return flex(q, keys, values, score_mod=score_mod, block_mask=mask, scale=spec.scale, enable_gqa=group > 1,
                    kernel_options=kernel_options)
    out, aux = flex(q, keys, values, score_mod=score_mod, block_mask=mask, scale=spec.scale, enable_gqa=group > 1,
                    return_aux=AuxRequest(lse=True), kernel_options=kernel_options)
    # softmax over keys + sink = softmax over keys * sum / (sum + e^sink) = ... * sigmoid(lse - sink)
    share = torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None])  # [B, heads, Q]
    return (out * share[..., None].to(out.dtype))
