"""Reference-counted allocator of KV block ids: a free list, no tensors."""
from __future__ import annotations

from collections import deque

from tandem.errors import KvCapacityExceeded


class BlockAllocator:
    """Hands out block ids from a free list. Reference counts let a block be shared (prefix sharing,
    forks): it returns to the free list only when its last holder frees it."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Takes n blocks, all or none."""
        if n > len(self._free):
            raise KvCapacityExceeded(n, len(self._free), self.num_blocks)
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder for each block (the caller copies the ids into another table)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
