"""Paged KV cache: one block pool per layer, allocated once, and per-sequence block tables."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.block_allocator import BlockAllocator
from models.zero_pool import lazy_zeros
from tandem.ceil_div import ceil_div
from tandem.errors import KvCapacityExceeded
from tandem.kv_usage import KvUsage

DEFAULT_BLOCK_SIZE = 16


@dataclass
class BlockTable:
    """The blocks one sequence holds, in order, and how many token slots it has written."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0


class PagedKvCache:
    """K and V pools shaped [layers, num_blocks, block_size, kv_heads, head_dim] plus the block accounting.

    Token t of a sequence lives in block `table.blocks[t // block_size]` at offset `t % block_size`; its
    flat slot index is `block * block_size + offset`.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = lazy_zeros(shape, dtype, device)  # zero unwritten; on CPU committed as used (zero_pool.py)
        self.v = lazy_zeros(shape, dtype, device)
        self.allocator = BlockAllocator(num_blocks)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    def usage(self) -> KvUsage:
        return KvUsage(self.block_size, self.num_blocks, self.allocator.num_free)

    def blocks_needed(self, table: BlockTable, new_length: int) -> int:
        """Blocks to add so `table` can hold `new_length` tokens."""
        return max(0, ceil_div(new_length, self.block_size) - len(table.blocks))

    def reserve(self, growth: list[tuple[BlockTable, int]]) -> None:
        """Grows every (table, new_length) pair, all or nothing: raises KvCapacityExceeded before touching
        any table when the pool cannot hold them all."""
        needs = [self.blocks_needed(t, n) for t, n in growth]
        total = sum(needs)
        if not self.allocator.can_allocate(total):
            raise KvCapacityExceeded(total, self.allocator.num_free, self.num_blocks)
        for (table, _), n in zip(growth, needs):
            if n:
                table.blocks.extend(self.allocator.allocate(n))

    def truncate(self, table: BlockTable, new_length: int) -> None:
        """Keeps the first new_length tokens; frees whole blocks past them (the stale tail of the last
        kept block is simply overwritten later)."""
        keep = ceil_div(new_length, self.block_size)
        if keep < len(table.blocks):
            self.allocator.free(table.blocks[keep:])
            del table.blocks[keep:]
        table.length = min(table.length, new_length)

    def release(self, table: BlockTable) -> None:
        self.allocator.free(table.blocks)
        table.blocks = []
        table.length = 0
