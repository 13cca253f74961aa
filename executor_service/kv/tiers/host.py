"""The host-memory KV tier (--kv-host-gb): evicted blocks kept in process memory, least recently used dropped
first, lost on restart. Its own module: it shares nothing with the disk tier but the block it holds."""
from __future__ import annotations

import threading
from collections import OrderedDict

from executor_service.kv.tiers.block_file import TierBlock


class HostTier:
    """Blocks in host memory, least recently used evicted past max_bytes. Lost on restart."""

    medium = "CPU"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[bytes, TierBlock] = OrderedDict()
        self._bytes = 0
        self._guard = threading.Lock()
        self.hits = self.written = self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: bytes) -> bool:
        return h in self._blocks

    def put(self, b: TierBlock) -> tuple[bool, list[bytes]]:
        """(whether the block is new here, the hashes evicted to make room)."""
        gone = []
        with self._guard:
            if b.hash in self._blocks:
                self._blocks.move_to_end(b.hash)
                return False, gone
            self._blocks[b.hash] = b
            self._bytes += len(b.data)
            self.written += 1
            while self._bytes > self.max_bytes and self._blocks:
                h, old = self._blocks.popitem(last=False)
                self._bytes -= len(old.data)
                gone.append(h)
            self.evicted += len(gone)
        return b.hash in self._blocks, gone

    def metas(self) -> list[TierBlock]:
        """Every block held (least recently used first)."""
        with self._guard:
            return list(self._blocks.values())

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, h: bytes) -> TierBlock | None:
        with self._guard:
            b = self._blocks.get(h)
            if b is not None:
                self._blocks.move_to_end(h)
                self.hits += 1
            return b

