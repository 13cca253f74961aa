"""KV blocks as bytes: what ExportKv sends, ImportKv writes and the tiers keep (docs/kv-transfer.md, 'Wire
format'). A block's bytes are every layer's K and V for its block_size slots, layer by layer, K then V, each
[block_size, num_kv_heads, head_dim] in the pool's dtype, little-endian (the pool's own memory order; every
platform torch runs these models on is little-endian). Checked with CRC-32C (google-crc32c: hardware CRC, GB/s).
"""
from __future__ import annotations

from typing import Sequence

import google_crc32c
import torch

from models.kv.paged_cache import PagedKvCache


def crc32c(data: bytes | memoryview) -> int:
    return google_crc32c.value(data)


def block_nbytes(kv: PagedKvCache) -> int:
    """Bytes of one block (K and V of every layer)."""
    layers, _, bs, heads, dim = kv.k.shape
    return 2 * layers * bs * heads * dim * kv.k.element_size()


def read_blocks(kv: PagedKvCache, blocks: Sequence[int]) -> list[bytes]:
    """The bytes of each block, copied out of the pool (to host memory) at once: the caller may free or rewrite
    the blocks right after."""
    if not blocks:
        return []
    with torch.inference_mode():
        idx = torch.tensor(list(blocks), dtype=torch.long, device=kv.k.device)
        # as bytes: the pool may be float8 (--kv-dtype), which has no index kernels on CPU (torch 2.13)
        k, v = kv.k.view(torch.uint8), kv.v.view(torch.uint8)  # [L, blocks, bs, H, D * element size]
        both = torch.stack((k.index_select(1, idx), v.index_select(1, idx)), dim=2)  # [L, n, 2, bs, H, D*e]
        host = both.transpose(0, 1).contiguous().cpu()  # [n, L, 2, bs, H, D*e]
    raw = host.numpy()
    return [raw[i].tobytes() for i in range(len(blocks))]


def write_blocks(kv: PagedKvCache, blocks: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Writes each payload (as read_blocks makes them) into its block of the pool."""
    if not blocks:
        return
    layers, _, bs, heads, dim = kv.k.shape
    size = block_nbytes(kv)
    for p in payloads:
        if len(p) != size:
            raise ValueError(f"a KV block is {size} bytes here, got {len(p)}")
    with torch.inference_mode():
        flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        host = flat.view(len(blocks), layers, 2, bs, heads, dim * kv.k.element_size())
        dev = host.to(kv.k.device, non_blocking=False).transpose(0, 1)  # [L, n, 2, bs, H, D*e]
        idx = torch.tensor(list(blocks), dtype=torch.long, device=kv.k.device)
        # as bytes, like read_blocks: float8 pools have no index_copy_ kernel on CPU
        kv.k.view(torch.uint8).index_copy_(1, idx, dev[:, :, 0].contiguous())
        kv.v.view(torch.uint8).index_copy_(1, idx, dev[:, :, 1].contiguous())
