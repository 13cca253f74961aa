"""Between the prefix cache and the KV tiers (executor_service/kv/tiers/store.py): what leaves the pool is copied out and spilled, and a
prompt's prefix that misses the pool is loaded back from the tiers. Both run under the model lock (the prefix
cache's callers hold it).

KV events name the tier a block is in (executor_service/kv/events/hub.py's mediums): the pool's removal is announced by the prefix
cache; what the host tier takes or drops is announced here at once (under the model lock, as the spill); what
the disk tier's writer thread writes or deletes is announced by that thread under the model lock too (one hold
per batch), so that an event never falls between a subscriber's snapshot and its subscription."""
from __future__ import annotations

from array import array
from typing import Callable, ContextManager, Sequence

from executor_service.kv.block_bytes import block_nbytes, read_blocks, write_blocks
from executor_service.kv.events.hub import BlocksRemoved, BlocksStored, KvEvent, KvEventHub
from executor_service.kv.tiers.block_file import TierBlock
from executor_service.kv.tiers.config import KvTierConfig
from executor_service.kv.tiers.disk import DiskTier
from executor_service.kv.tiers.host import HostTier
from executor_service.kv.tiers.store import TierChange, TierStats, TierStore
from models.kv.paged_cache import PagedKvCache

LockFactory = Callable[[], ContextManager[None]]


class TierLink:
    def __init__(self, kv: PagedKvCache, store: TierStore, events: KvEventHub | None = None,
                 lock: LockFactory | None = None) -> None:
        self.kv = kv
        self.store = store
        self.events = events
        self._lock = lock
        self.loaded = 0  # blocks loaded back into the pool
        if events is not None and lock is not None:
            store.on_disk_change = self._announce_locked

    @staticmethod
    def open(kv: PagedKvCache, fingerprint: str, config: KvTierConfig, events: KvEventHub | None = None,
             lock: LockFactory | None = None) -> "TierLink | None":
        """events, lock: the executor's KV event hub and a factory of its model lock (a control operation), for
        KV events naming the tiers; without them the tiers announce nothing. Raises DiskTierUnusable when
        config.disk_dir cannot hold a tier."""
        if not config.host_gb and config.disk_dir is None:
            return None
        host = HostTier(int(config.host_gb * 2**30)) if config.host_gb else None
        disk = DiskTier(config.disk_dir, int(config.disk_gb * 2**30), fingerprint, block_nbytes(kv),
                        config.disk_fsync) if config.disk_dir is not None else None
        return TierLink(kv, TierStore(host, disk), events, lock)

    def spill(self, evicted: list[tuple[bytes, int, tuple[bytes, str, bytes]]]) -> None:
        """(hash, pool block, (parent, adapter, token bytes)) of blocks being evicted, their data still intact."""
        data = read_blocks(self.kv, [b for _, b, _ in evicted])
        changes = self.store.spill([TierBlock(h, m[0], m[1], m[2], d) for (h, _, m), d in zip(evicted, data)])
        for change in changes:
            self._announce(change)

    def load(self, hashes: Sequence[bytes]) -> list[TierBlock]:
        """The leading run of hashes found intact in the tiers (stops at the first miss)."""
        out = []
        for h in hashes:
            if not self.store.has(h):
                break
            b = self.store.get(h)
            if b is None:
                gone = self.store.disk.take_removed() if self.store.disk is not None else []
                if gone:  # a corrupt or deleted file (or the whole directory), now out of the index
                    self._announce(TierChange(DiskTier.medium, [], gone))
                break
            out.append(b)
        return out

    def write(self, blocks: list[int], tier_blocks: list[TierBlock]) -> None:
        write_blocks(self.kv, blocks, [b.data for b in tier_blocks])
        self.loaded += len(blocks)

    def snapshot(self) -> list[KvEvent]:
        """Every block the tiers hold, as stored events (one per block), for a new subscriber."""
        out: list[KvEvent] = []
        for tier in (self.store.host, self.store.disk):
            if tier is not None:
                out.extend(_stored(tier.medium, [b], self.kv.block_size) for b in tier.metas())
        return out

    def stats(self) -> list[TierStats]:
        return self.store.stats()

    def _announce(self, change: TierChange) -> None:
        if self.events is None or not self.events.active:
            return
        for run in _runs(change.stored):
            self.events.publish(_stored(change.medium, run, self.kv.block_size))
        if change.removed:
            self.events.publish(BlocksRemoved(tuple(change.removed), change.medium))

    def _announce_locked(self, change: TierChange) -> None:
        """The disk writer's changes, announced under the model lock (on the writer thread)."""
        assert self._lock is not None
        if self.events is None or not self.events.active:
            return
        with self._lock():
            self._announce(change)


def _stored(medium: str, run: list[TierBlock], block_size: int) -> BlocksStored:
    ids = tuple(t for b in run for t in array("I", b.token_ids))
    return BlocksStored(tuple(b.hash for b in run), run[0].parent, run[0].adapter, len(run) * block_size, ids, medium)


def _runs(blocks: list[TierBlock]) -> list[list[TierBlock]]:
    """blocks split where one's parent is not the block before it (an event's hashes chain from one parent)."""
    runs: list[list[TierBlock]] = []
    for b in blocks:
        if runs and b.parent == runs[-1][-1].hash and b.adapter == runs[-1][-1].adapter:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs
