"""Paged KV cache: one block pool per layer, allocated once, and per-sequence block tables.

Blocks indexed for prefix caching (models/kv/block_allocator.py) may be shared by several tables and must never
change: `reserve` gives a table a private copy of its last block before the table writes into it when that
block is indexed (a cache truncated into a cached block, e.g. after rejected draft tokens).

Sliding windows (`window`: a model whose every layer slides, ModelConfig.kv_window): a query at position p
reads keys p - window + 1 .. p only, so after each step `slide` frees the blocks wholly before the next
query's window, and a sequence holds at most window / block_size + 1 blocks (plus what one step adds) however
long it grows. A freed block's entry in the table becomes the pool's *null block*: one extra block past the
allocator's, never allocated nor written (zeros), so block tables stay indexed by position and attention,
whose window mask hides those positions anyway, reads it harmlessly (vLLM's null block). Freed entries are
always the table's first `dropped` ones. A freed block that was indexed for prefix caching stays indexed
(free-but-cached): its K/V are still those of its prefix, so a later prompt may adopt it. A truncation back
into freed blocks is refused (CacheStateConflict): their K/V are gone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from models.kv.block_allocator import BlockAllocator
from models.memory.zero_pool import lazy_zeros
from tandem.ceil_div import ceil_div
from tandem.errors import CacheStateConflict, KvCapacityExceeded
from tandem.kv_usage import KvUsage

DEFAULT_BLOCK_SIZE = 16


@dataclass
class BlockTable:
    """The blocks one sequence holds, in order, and how many token slots it has written."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0
    # Content hashes of the full blocks, in order (prefix caching; empty when it is off): hashes[i] is
    # blocks[i]'s hash, chained from hashes[i - 1]. len(hashes) <= length // block_size.
    hashes: list[bytes] = field(default_factory=list)
    dropped: int = 0  # leading blocks that left a sliding window: freed, their entries the null block

    @property
    def held(self) -> int:
        """Blocks this table holds in the pool."""
        return len(self.blocks) - self.dropped


class PagedKvCache:
    """K and V pools shaped [layers, num_blocks, block_size, kv_heads, head_dim] plus the block accounting.

    Token t of a sequence lives in block `table.blocks[t // block_size]` at offset `t % block_size`; its
    flat slot index is `block * block_size + offset`.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, window: int | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.window = window  # every layer's sliding window (None: full attention somewhere; nothing slides)
        self.null_block = num_blocks  # (sliding only) the extra, never-written block freed entries point at
        shape = (num_layers, num_blocks + (window is not None), block_size, num_kv_heads, head_dim)
        self.k = lazy_zeros(shape, dtype, device)  # zero unwritten; on CPU committed as used (zero_pool.py)
        self.v = lazy_zeros(shape, dtype, device)
        self.allocator = BlockAllocator(num_blocks)
        self.copied_blocks = 0  # indexed blocks copied before a write (see reserve)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    def usage(self) -> KvUsage:
        return KvUsage(self.block_size, self.num_blocks, self.allocator.num_free,
                       cached_blocks=self.allocator.num_cached)

    def blocks_needed(self, table: BlockTable, new_length: int) -> int:
        """Blocks to add so `table` can hold `new_length` tokens (a private copy of an indexed last block
        it would write into included)."""
        return max(0, ceil_div(new_length, self.block_size) - len(table.blocks)) + self._needs_copy(table, new_length)

    def reserve(self, growth: list[tuple[BlockTable, int]]) -> None:
        """Grows every (table, new_length) pair, all or nothing: raises KvCapacityExceeded before touching
        any table when the pool cannot hold them all."""
        needs = [self.blocks_needed(t, n) for t, n in growth]
        total = sum(needs)
        if not self.allocator.can_allocate(total):
            raise KvCapacityExceeded(total, self.allocator.num_free, self.num_blocks)
        for (table, new_length), n in zip(growth, needs):
            if self._needs_copy(table, new_length):
                self._copy_last_block(table)
                n -= 1
            if n:
                table.blocks.extend(self.allocator.allocate(n))

    def adopt(self, table: BlockTable, blocks: list[int], hashes: list[bytes]) -> None:
        """Starts an empty table with indexed full blocks (a matched prefix), pinned from now on."""
        if table.blocks:
            raise ValueError("adopt needs an empty table")
        self.allocator.pin(blocks)
        table.blocks = list(blocks)
        table.hashes = list(hashes)
        table.length = len(blocks) * self.block_size

    def slide(self, table: BlockTable) -> int:
        """Frees the blocks wholly before the window of the table's next query (position table.length); a
        no-op without a window. Returns the blocks freed."""
        if self.window is None:
            return 0
        first = max(0, table.length - self.window + 1) // self.block_size  # first block the next query reads
        gone = table.blocks[table.dropped:first]
        if gone:
            self.allocator.free(reversed(gone))
            table.blocks[table.dropped:first] = [self.null_block] * len(gone)
            table.dropped = first
        return len(gone)

    def truncate(self, table: BlockTable, new_length: int) -> None:
        """Keeps the first new_length tokens; frees whole blocks past them (the stale tail of the last
        kept block is overwritten later, in a private copy if that block is indexed). Raises
        CacheStateConflict, changing nothing, when the window of position new_length reaches freed blocks."""
        keep = ceil_div(new_length, self.block_size)
        if self.window is not None and table.dropped and new_length < table.length:
            first = max(0, new_length - self.window + 1) // self.block_size
            if new_length and first < table.dropped:
                raise CacheStateConflict(
                    f"cannot truncate to {new_length} tokens: the sliding window ({self.window} tokens) of that "
                    f"position reaches blocks already freed (positions before {table.dropped * self.block_size})")
        if keep < len(table.blocks):
            self.allocator.free(reversed(table.blocks[max(keep, table.dropped):]))
            del table.blocks[keep:]
            table.dropped = min(table.dropped, keep)
        del table.hashes[new_length // self.block_size:]
        table.length = min(table.length, new_length)

    def release(self, table: BlockTable) -> None:
        self.allocator.free(reversed(table.blocks[table.dropped:]))
        table.blocks = []
        table.hashes = []
        table.length = 0
        table.dropped = 0

    def undo_copy(self, table: BlockTable, last_block: int | None) -> None:
        """Gives the table back its last block `last_block` after a failed call made a private copy of it
        (reserve, then the call failed): the copy is freed, unless the original has since been evicted (then
        the copy, holding the same data, stays)."""
        if last_block is None or not table.blocks or table.blocks[-1] == last_block:
            return
        if self.allocator.is_indexed(last_block):  # still in the index: never evicted, so never rewritten
            self.allocator.pin([last_block])
            self.allocator.free([table.blocks[-1]])
            table.blocks[-1] = last_block
            self.copied_blocks -= 1

    def _needs_copy(self, table: BlockTable, new_length: int) -> int:
        """1 when growing the table writes into its last block and that block is indexed (shared, immutable)."""
        return int(new_length > table.length and table.length % self.block_size != 0
                   and self.allocator.is_indexed(table.blocks[-1]))

    def _copy_last_block(self, table: BlockTable) -> None:
        """Copy-on-write: the table's indexed last block is replaced by a private copy of it (all layers)."""
        old = table.blocks[-1]
        (new,) = self.allocator.allocate(1)
        with torch.inference_mode():
            self.k[:, new].copy_(self.k[:, old])  # [layers, block_size, kv_heads, head_dim]
            self.v[:, new].copy_(self.v[:, old])
        table.blocks[-1] = new
        self.allocator.free([old])
        self.copied_blocks += 1


def decode_block_table(tables: Sequence[Sequence[int]], pasts: Sequence[int], block_size: int, rows: int,
                       min_width: int = 1) -> np.ndarray:
    """The block table of a decode step: row i holds the blocks of tables[i] that positions 0..pasts[i] use
    (the new token's included), padded with block 0; rows past len(tables) are all 0. -> int64 [rows, W],
    W = max(min_width, the widest row)."""
    width = max(min_width, max(ceil_div(p + 1, block_size) for p in pasts))
    table = np.zeros((rows, width), dtype=np.int64)
    for i, (blocks, past) in enumerate(zip(tables, pasts)):
        used = ceil_div(past + 1, block_size)
        table[i, :used] = blocks[:used]
    return table
