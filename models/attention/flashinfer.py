"""Paged attention through FlashInfer (`flashinfer-python`) on CUDA: the pool read in place through its page table.

UNTESTED HERE: no machine this project has run on had CUDA and flashinfer together (docs/cuda.md; the first
lent GPU runs it through scripts/gpu_check). Everything else the executor does is tested on CPU; this module
is only imported when flashinfer is (models/attention/backend.py), and a failure to plan is a start-up error.

One `BatchPrefillWithPagedKVCacheWrapper` plan per batch (every item: its new tokens as the ragged query,
its block table as the page list, causal aligned to the end of its context), run per layer over the pool in
its own NHD layout `[blocks, block_size, kv_heads, d]`, which is ours. Sliding windows map to `window_left`
(window - 1) and soft-capping to `logits_soft_cap`; a plan is per (window, softcap) pair, made on first use.
Sinks are not passed (models/attention/backend.py routes models with sinks to flex).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from models.attention.paged import ItemLayout
from models.attention.spec import AttentionSpec
from models.kv.paged_cache import PagedKvCache
from tandem.ceil_div import ceil_div

WORKSPACE_BYTES = 128 << 20  # FlashInfer's scratch buffer (its examples' size)

_workspace: dict[torch.device, torch.Tensor] = {}


class FlashInferMetadata:
    def __init__(self, items: Sequence[ItemLayout], block_size: int, heads: int, kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        import flashinfer  # noqa: PLC0415 (imported only where it is installed)

        self._flashinfer: Any = flashinfer
        positions, slots, pages, page_ptr, q_ptr, last = [], [], [], [0], [0], []
        for it in items:
            pos = np.arange(it.past, it.past + it.n_new, dtype=np.int64)
            blocks = np.asarray(it.blocks, dtype=np.int64)
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
            ctx = it.past + it.n_new
            used = ceil_div(ctx, block_size)
            pages.append(blocks[:used])
            page_ptr.append(page_ptr[-1] + used)
            q_ptr.append(q_ptr[-1] + it.n_new)
            last.append(ctx - (used - 1) * block_size)
        t = lambda a, dt=torch.int32: torch.as_tensor(np.asarray(a), dtype=dt).to(device)  # noqa: E731
        self.num_tokens = q_ptr[-1]
        self.positions = t(np.concatenate(positions), torch.int64)
        self.slot_mapping = t(np.concatenate(slots), torch.int64)
        self._plan_args = (t(q_ptr), t(page_ptr), t(np.concatenate(pages)), t(last))
        self._shape = (heads, kv_heads, head_dim, block_size)
        self._dtype, self._device = dtype, device
        self._wrappers: dict[tuple[int | None, float | None, float], Any] = {}

    def _wrapper(self, spec: AttentionSpec) -> Any:
        key = (spec.window, spec.softcap, spec.scale)
        if key not in self._wrappers:
            if self._device not in _workspace:
                _workspace[self._device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self._device)
            w = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace[self._device], "NHD")
            heads, kv_heads, d, bs = self._shape
            w.plan(*self._plan_args, heads, kv_heads, d, bs, causal=True, sm_scale=spec.scale,
                   window_left=-1 if spec.window is None else spec.window - 1, logits_soft_cap=spec.softcap,
                   q_data_type=self._dtype, kv_data_type=self._dtype)
            self._wrappers[key] = w
        return self._wrappers[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKvCache, layer: int,
               spec: AttentionSpec, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d] -> [T, heads * d]."""
        if sinks is not None:
            raise ValueError("the flashinfer attention backend does not take sinks (use --attention-backend flex)")
        total, heads, d = q.shape
        kv_heads = k.shape[1]
        k_pool, v_pool = cache.k[layer], cache.v[layer]
        k_pool.view(-1, kv_heads, d).index_copy_(0, self.slot_mapping, k)
        v_pool.view(-1, kv_heads, d).index_copy_(0, self.slot_mapping, v)
        out = self._wrapper(spec).run(q.contiguous(), (k_pool, v_pool))  # [T, heads, d]
        return out.reshape(total, heads * d)
