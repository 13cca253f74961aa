"""Between the prefix cache and the KV tiers (kv_tier.py): what leaves the pool is copied out and spilled, and a
prompt's prefix that misses the pool is loaded back from the tiers. Both run under the model lock (the prefix
cache's callers hold it)."""
from __future__ import annotations

from typing import Sequence

from executor_service.kv_block_bytes import block_nbytes, read_blocks, write_blocks
from executor_service.kv_tier import DiskTier, HostTier, TierBlock, TierStore
from models.kv_cache import PagedKvCache


class TierLink:
    def __init__(self, kv: PagedKvCache, store: TierStore) -> None:
        self.kv = kv
        self.store = store
        self.loaded = 0  # blocks loaded back into the pool

    @staticmethod
    def open(kv: PagedKvCache, fingerprint: str, host_gb: float, disk_dir, disk_gb: float) -> "TierLink | None":
        if not host_gb and disk_dir is None:
            return None
        host = HostTier(int(host_gb * 2**30)) if host_gb else None
        disk = DiskTier(disk_dir, int(disk_gb * 2**30), fingerprint, block_nbytes(kv)) if disk_dir is not None else None
        return TierLink(kv, TierStore(host, disk))

    def spill(self, evicted: list[tuple[bytes, int, tuple[bytes, str, bytes]]]) -> None:
        """(hash, pool block, (parent, adapter, token bytes)) of blocks being evicted, their data still intact."""
        data = read_blocks(self.kv, [b for _, b, _ in evicted])
        self.store.spill([TierBlock(h, m[0], m[1], m[2], d) for (h, _, m), d in zip(evicted, data)])

    def load(self, hashes: Sequence[bytes]) -> list[TierBlock]:
        """The leading run of hashes found intact in the tiers (stops at the first miss)."""
        out = []
        for h in hashes:
            if not self.store.has(h):
                break
            b = self.store.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def write(self, blocks: list[int], tier_blocks: list[TierBlock]) -> None:
        write_blocks(self.kv, blocks, [b.data for b in tier_blocks])
        self.loaded += len(blocks)
