"""Reference-counted allocator of KV block ids with a content-hash index (prefix caching): no tensors.

A block is free (in no cache), or held by one or more caches (its reference count). A full block whose
content hash is registered is *indexed*: a later prompt with the same prefix reuses it (`lookup` + `pin`)
instead of recomputing it. Indexed blocks are never written again (PagedKvCache copies one before a cache
writes into it). When its last holder frees an indexed block it stays in the index as free-but-cached, and
allocation takes such blocks only after every never-cached free block is gone, least recently used first;
taking one removes its hash from the index (reported through on_removed).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Iterable

from tandem.errors import KvCapacityExceeded


class BlockAllocator:
    def __init__(self, num_blocks: int, on_removed: Callable[[list[bytes]], None] | None = None) -> None:
        """on_removed: called with the hashes of cached blocks taken for other data (evicted)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_removed = on_removed
        self._free: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but indexed, least recently used first
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._index: dict[bytes, int] = {}
        self.evicted = 0  # cached blocks taken for other data since start

    @property
    def num_free(self) -> int:
        """Blocks no cache holds (cached ones included: they are taken when needed)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks that hold an indexed prefix (evictable)."""
        return len(self._cached)

    @property
    def num_indexed(self) -> int:
        return len(self._index)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Takes n blocks, all or none: never-cached free blocks first, then the least recently used cached
        ones (their hashes leave the index)."""
        if n > self.num_free:
            raise KvCapacityExceeded(n, self.num_free, self.num_blocks)
        blocks = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        removed = []
        while len(blocks) < n:
            b, _ = self._cached.popitem(last=False)
            removed.append(self._unindex(b))
            blocks.append(b)
        for b in blocks:
            self._refs[b] = 1
        if removed:
            self.evicted += len(removed)
            if self.on_removed is not None:
                self.on_removed(removed)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more holder for each held block (the caller copies the ids into another table)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """One holder less for each block. Free a table's blocks last first: the tail of a cached prefix is
        then the first of it to be evicted, and its head (shared by more prompts) stays longest."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash[b] is not None:
                    self._cached[b] = None  # most recently used end
                else:
                    self._free.appendleft(b)  # reused first: already-touched memory (the CPU pool is lazy)

    # ----------------------------------------------------------------- the hash index
    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The blocks of the longest prefix of hashes that is indexed (not pinned: see pin)."""
        blocks = []
        for h in hashes:
            b = self._index.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def pin(self, blocks: Iterable[int]) -> None:
        """One more holder for each indexed block (free-but-cached ones leave the eviction queue)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._cached[b]
            self._refs[b] += 1

    def register(self, block: int, block_hash: bytes) -> bool:
        """Indexes a held, full block under its content hash. False (nothing changes) when another block
        already holds that hash (two caches computed the same prefix at once): the first one stays."""
        if block_hash in self._index or self._hash[block] is not None:
            return False
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._index[block_hash] = block
        self._hash[block] = block_hash
        return True

    def is_indexed(self, block: int) -> bool:
        return self._hash[block] is not None

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def indexed(self) -> list[bytes]:
        """Every indexed hash (for a snapshot)."""
        return list(self._index)

    def indexed_by_recency(self) -> list[bytes]:
        """Every indexed hash, least recently used first: the free-but-cached ones in the order they would be
        evicted, then the held ones (in use now, so the most recent)."""
        held = [h for h, b in self._index.items() if self._refs[b] > 0]
        return [self._hash[b] for b in self._cached] + held

    def _unindex(self, block: int) -> bytes:
        h = self._hash[block]
        self._hash[block] = None
        del self._index[h]
        return h
