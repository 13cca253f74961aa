"""Paged attention for a packed mixed batch.

A batch is a list of items, each `n_new` tokens appended to a sequence that already holds `past` tokens
in its block table. Their tokens are packed into one `[T, ...]` tensor for every linear layer. For
attention the items are split into two buckets, each handled by a fixed number of tensor ops per layer:

- decode bucket: items with one new token (query length 1);
- prefill bucket: items with several new tokens (prefill or a prefill chunk), queries padded to the
  longest chunk.

Per bucket and layer: gather the K/V blocks of every item through its block table (one index op each),
one `scaled_dot_product_attention` call with an additive mask (causal within the chunk, and hiding padding
and other sequences' garbage), and a scatter back to packed order. Grouped-query attention is handled by
folding the query heads that share a KV head into the query-length axis, so K/V are never repeated.

A bucket pads every item to its longest context (and a prefill bucket to its longest chunk), so its
workspace is rows x padded queries x longest context ("attention elements"; the gathered K/V and the scores
grow with it): one long sequence among many short ones would make every row as long as it. With a limit
(`max_elements`, the executor's --max-attention-elements) a bucket over it is split into sub-buckets of
items of similar context length (sorted, longest first), each within the limit unless a single item alone
exceeds it. Each item's attention is computed the same way in any bucket, so splitting changes no result.

Sliding-window layers (models/attention/spec.py) use a second mask per bucket, made on first use and shared by
every layer with that window: it also hides keys more than window - 1 positions before each query (blocks
that left an all-sliding model's window are its cache's null block, models/kv/paged_cache.py: always hidden).
Soft-capping and sinks take the explicit-scores path of attention_spec.attend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from models.attention.spec import AttentionSpec, attend
from models.kv.paged_cache import PagedKvCache
from models.kv.dtype import load_kv, store_kv
from tandem.ceil_div import ceil_div


@dataclass(frozen=True)
class ItemLayout:
    """Where one item's new tokens go: its block ids, tokens already cached, tokens added now."""

    blocks: Sequence[int]
    past: int
    n_new: int
    # Position ranges [start, end) whose tokens see each other both ways (one image's tokens, Gemma 3): a query
    # in one also sees the keys after it up to the range's end, which lies within this item's tokens (validated:
    # executor_service/vision/image_checks.py). Only the gathered backend applies them (models/attention/backend.py).
    bidirectional: tuple[tuple[int, int], ...] = ()


def token_slots(items: Sequence[ItemLayout], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each new token's position in its sequence and its flat slot in the pool (block id x block_size +
    offset), items after one another: ([T], [T]) int64."""
    positions, slots = [], []
    for it in items:
        pos = np.arange(it.past, it.past + it.n_new, dtype=np.int64)
        blocks = np.asarray(it.blocks, dtype=np.int64)
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    return np.concatenate(positions), np.concatenate(slots)


@dataclass
class _Bucket:
    token_index: torch.Tensor  # [n] positions of this bucket's tokens in the packed batch
    batch_index: torch.Tensor  # [n] item row within the bucket
    query_index: torch.Tensor  # [n] query slot within the item's padded chunk
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with block 0, masked out)
    mask: torch.Tensor  # [B, 1, group * max_q, L] additive float mask (0 or -inf); L = longest context
    max_q: int
    covers_batch: bool  # the bucket holds every token of the batch, in packed order
    fresh: bool  # every item starts at position 0 with the same length: plain causal attention suffices
    limit: torch.Tensor  # [B, 1, group * max_q, 1] the position of each query row (the window's reference)
    windowed: dict[int, torch.Tensor]  # window -> its additive mask (as `mask`), made on first use

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self.windowed:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.windowed[window] = self.mask.masked_fill(keys <= self.limit - window, float("-inf"))
        return self.windowed[window]


class AttentionMetadata:
    """Everything attention needs for one packed batch, built once and shared by all layers."""

    def __init__(self, items: Sequence[ItemLayout], block_size: int, group: int, device: torch.device,
                 dtype: torch.dtype, max_elements: int | None = None) -> None:
        positions, slots = token_slots(items, block_size)
        self.items = tuple(items)  # what it was built from: tensor-parallel workers rebuild it (executor_service/tp/leader.py)
        self.num_tokens = int(sum(it.n_new for it in items))
        self.positions = torch.from_numpy(positions).to(device)  # [T]
        self.slot_mapping = torch.from_numpy(slots).to(device)  # [T]
        starts = np.cumsum([0] + [it.n_new for it in items])[:-1]
        decode = [i for i, it in enumerate(items) if it.n_new == 1]
        prefill = [i for i, it in enumerate(items) if it.n_new > 1]
        parts = [part for idx in (decode, prefill) if idx for part in split_bucket(items, idx, max_elements)]
        self.buckets = [
            self._bucket([items[i] for i in part], starts[part], block_size, group, device, dtype,
                         len(part) == len(items))  # only an unsplit bucket holds them all (in packed order)
            for part in parts
        ]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKvCache, layer: int,
               spec: AttentionSpec, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d]: paged_attention over this batch -> [T, heads * d]."""
        return paged_attention(q, k, v, cache, layer, self, spec, sinks)

    @staticmethod
    def _bucket(items: list[ItemLayout], starts: np.ndarray, block_size: int, group: int,
                device: torch.device, dtype: torch.dtype, covers_batch: bool) -> _Bucket:
        n_new = np.array([it.n_new for it in items], dtype=np.int64)
        past = np.array([it.past for it in items], dtype=np.int64)
        max_q = int(n_new.max())
        ctx = past + n_new
        max_blocks = ceil_div(int(ctx.max()), block_size)
        tables = np.zeros((len(items), max_blocks), dtype=np.int64)
        for row, it in enumerate(items):
            used = ceil_div(it.past + it.n_new, block_size)
            tables[row, :used] = it.blocks[:used]
        batch_index = np.repeat(np.arange(len(items)), n_new)
        query_index = np.arange(int(n_new.sum())) - np.repeat(np.cumsum(n_new) - n_new, n_new)
        token_index = np.repeat(starts, n_new) + query_index
        # Query i of an item sits at position past+i and sees keys 0..past+i. Padded query rows
        # (i >= n_new) see the item's whole context: never an all-masked row (which would give NaN),
        # and their output is discarded.
        t = torch.from_numpy
        limit = torch.minimum(t(past)[:, None] + torch.arange(max_q)[None, :], t(ctx)[:, None] - 1)  # [B, max_q]
        # Keys past the longest context are padding in every row: trim them (a view) rather than mask them.
        keys = torch.arange(int(ctx.max()))
        mask = keys[None, None, :] <= _reach(items, limit)[:, :, None]  # [B, max_q, L], L = longest context
        # Rows are ordered (group, query) to match the folded GQA query layout.
        mask = mask[:, None].expand(-1, group, -1, -1).reshape(len(items), 1, group * max_q, -1)
        # Additive float form, built once per batch: a boolean mask is converted by every SDPA call,
        # i.e. once per layer.
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        rows = limit[:, None].expand(-1, group, -1).reshape(len(items), 1, group * max_q, 1)
        return _Bucket(t(token_index).to(device), t(batch_index).to(device), t(query_index).to(device),
                       t(tables).to(device), additive.to(device), max_q, covers_batch,
                       bool(max_q > 1 and not past.any() and (n_new == max_q).all()
                            and not any(it.bidirectional for it in items)), rows.to(device), {})


def _reach(items: Sequence[ItemLayout], limit: torch.Tensor) -> torch.Tensor:
    """Each query row's last visible key: its own position (limit, [B, max_q]), or for a query inside a
    bidirectional range the range's last position. Causal OR same-range is one bound, as every key between the
    query and the range's end lies in the range; a sliding window still counts back from the query's own position
    (transformers' Gemma 3: AND(window, OR(causal, block)))."""
    if not any(it.bidirectional for it in items):
        return limit
    reach = limit.clone()
    for row, it in enumerate(items):
        for lo, hi in it.bidirectional:
            q = torch.arange(max(lo, it.past), min(hi, it.past + it.n_new)) - it.past  # its queries in this chunk
            reach[row, q] = hi - 1
    return reach


def attention_elements(items: Sequence[ItemLayout]) -> int:
    """The workspace of one bucket of these items, per query head: rows x padded queries x longest context."""
    return len(items) * max(it.n_new for it in items) * max(it.past + it.n_new for it in items)


def split_bucket(items: Sequence[ItemLayout], idx: list[int], max_elements: int | None) -> list[list[int]]:
    """The item indices `idx` of one bucket, as they are when within max_elements (or no limit), else as
    sub-buckets each within it (a single item over it forms its own): items sorted by context, longest first,
    and packed greedily, so each sub-bucket pads to a context close to its items' own."""
    if max_elements is None or attention_elements([items[i] for i in idx]) <= max_elements:
        return [idx]
    parts: list[list[int]] = []
    rows = max_q = longest = 0
    for i in sorted(idx, key=lambda i: items[i].past + items[i].n_new, reverse=True):
        it = items[i]
        q, ctx = max(max_q, it.n_new), max(longest, it.past + it.n_new)
        if parts and (rows + 1) * q * ctx <= max_elements:
            parts[-1].append(i)
            rows, max_q, longest = rows + 1, q, ctx
        else:
            parts.append([i])
            rows, max_q, longest = 1, it.n_new, it.past + it.n_new
    return parts


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKvCache, layer: int,
                    meta: AttentionMetadata, spec: AttentionSpec, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d] for the packed batch. Writes k/v into the cache slots, then
    attends every query to its own sequence's cached keys. Returns [T, heads * d]."""
    scale = spec.scale
    total, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    k_pool = cache.k[layer]  # [num_blocks, block_size, kv_heads, d]
    v_pool = cache.v[layer]
    store_kv(k_pool, meta.slot_mapping, k)  # converted to the pool's dtype (--kv-dtype, models/kv/dtype.py)
    store_kv(v_pool, meta.slot_mapping, v)
    out = q.new_empty(total, heads, d)
    for b in meta.buckets:  # decode, prefill: one each, or sub-buckets of them under max_elements
        rows, max_q = b.block_tables.shape[0], b.max_q
        if b.fresh and spec.plain and sinks is None and k_pool.dtype == q.dtype:
            # Whole prompts from position 0: their keys are this step's k/v, and the mask is plain causal,
            # which lets the kernel skip the upper triangle. (Not for a pool in another dtype: every read sees
            # the K/V as stored, as the flex path's do.)
            ob = _causal(q if b.covers_batch else q[b.token_index], k if b.covers_batch else k[b.token_index],
                         v if b.covers_batch else v[b.token_index], rows, scale)  # [B * n, heads * d]
            if b.covers_batch:
                return ob
            out[b.token_index] = ob.view(-1, heads, d)
            continue
        # keys/values: [B * max_blocks, block_size, kv_heads, d] -> [B, kv_heads, L, d]
        flat_tables = b.block_tables.view(-1)
        length = b.mask.shape[-1]
        keys = load_kv(k_pool.index_select(0, flat_tables), q.dtype).view(rows, -1, kv_heads, d)[:, :length]
        values = load_kv(v_pool.index_select(0, flat_tables), q.dtype).view(rows, -1, kv_heads, d)[:, :length]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        if max_q == 1:
            # [B, kv_heads, group, d]; an all-decode batch needs no gather.
            qb = (q if b.covers_batch else q[b.token_index]).view(rows, kv_heads, group, d)
        else:
            padded = q.new_zeros(rows, max_q, heads, d)
            padded[b.batch_index, b.query_index] = q[b.token_index]
            # [B, max_q, kv_heads, group, d] -> [B, kv_heads, group * max_q, d]
            qb = padded.view(rows, max_q, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(
                rows, kv_heads, group * max_q, d)
        ob = attend(qb, keys, values, b.mask_for(spec.window), spec, sinks)
        if max_q == 1 and b.covers_batch:
            return ob.reshape(total, heads * d)
        if max_q == 1:
            out[b.token_index] = ob.reshape(rows, heads, d)
        else:
            ob = ob.view(rows, kv_heads, group, max_q, d).permute(0, 3, 1, 2, 4).reshape(rows, max_q, heads, d)
            out[b.token_index] = ob[b.batch_index, b.query_index]
    return out.view(total, heads * d)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, scale: float) -> torch.Tensor:
    """q: [B * n, heads, d]; k, v: [B * n, kv_heads, d], each item n tokens from position 0 -> [B * n, heads * d]."""
    heads, d = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    qb = q.view(rows, -1, heads, d).transpose(1, 2)  # [B, heads, n, d]
    kb = k.view(rows, -1, k.shape[1], d).transpose(1, 2)  # [B, kv_heads, n, d]
    vb = v.view(rows, -1, v.shape[1], d).transpose(1, 2)
    if group > 1:
        kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)  # [B, heads, n, d]
    ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)  # [B, heads, n, d]
    return ob.transpose(1, 2).reshape(-1, heads * d)
