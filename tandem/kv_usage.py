"""KV block usage: what the executor's pool holds and what a scheduler sees of it (one type for both sides)."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.ceil_div import ceil_div


@dataclass(frozen=True)
class KvUsage:
    block_size: int  # tokens per block
    total_blocks: int
    free_blocks: int
    active_caches: int = 0  # caches held (0 where only the pool is described)
    cached_blocks: int = 0  # of free_blocks, those holding an indexed prefix (evictable; prefix caching)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a cache of this many tokens occupies."""
        return ceil_div(tokens, self.block_size)
