"""KV tiers under the prefix cache (docs/kv-transfer.md, 'Tiers'): the store stacks the host tier (executor_service/
kv/tiers/host.py) over the disk tier (executor_service/kv/tiers/disk.py). A full block the pool evicts is copied
out (under the model lock, at once: its slot is about to be rewritten) and kept in host memory and on disk, the
latter written by a background thread, never on a step's path. A CreateCache whose prefix misses the pool
continues the match here and loads the blocks back (executor_service/kv/prefix_cache.py).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from executor_service.kv.tiers.block_file import TierBlock
from executor_service.kv.tiers.disk import DiskTier
from executor_service.kv.tiers.host import HostTier

log = logging.getLogger("tandem.executor.kv_tier")
SPILL_QUEUE = 4096  # blocks waiting for the writer; more are dropped (counted), never waited for
_WRITE_BATCH = 64  # blocks the writer writes before announcing them (one model-lock hold per batch)


@dataclass(frozen=True)
class TierChange:
    """What one tier took and dropped (KV events announce it: executor_service/kv/tiers/link.py)."""

    medium: str
    stored: list[TierBlock]  # new there (data may be left out)
    removed: list[bytes]  # hashes it no longer holds


@dataclass(frozen=True)
class TierStats:
    """One tier's state and counters since start, for the metrics."""

    medium: str
    blocks: int
    bytes: int
    hits: int  # blocks loaded back from it into the pool
    written: int  # blocks it took
    evicted: int  # blocks it dropped for room
    corrupt: int  # block files found truncated, corrupt or foreign (never served, deleted); 0 in host memory
    read_bytes: int = 0  # disk: bytes of the block files loaded back
    read_seconds: float = 0.0  # disk: time reading and checking them (read bandwidth = read_bytes / read_seconds)
    write_errors: int = 0  # disk: blocks not written because the disk refused (full, read-only, I/O error)
    writable: bool = True  # disk: False while its writes are stopped (executor_service/kv/tiers/disk_writes.py)
    missing: int = 0  # disk: block files found deleted under the executor (dropped from the index)


class TierStore:
    """The host and disk tiers together, and the writer thread that fills the disk tier."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None) -> None:
        self.host, self.disk = host, disk
        self.dropped = 0  # spills not kept because the writer was too far behind
        # Called on the writer thread with what a batch of writes changed on disk (executor_service/kv/tiers/link.py publishes it
        # under the model lock); None: nobody listens.
        self.on_disk_change: Callable[[TierChange], None] | None = None
        self._queue: queue.Queue[TierBlock] = queue.Queue(SPILL_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        if disk is not None:  # (a host tier alone needs no writer)
            self._writer.start()

    def spill(self, blocks: list[TierBlock]) -> list[TierChange]:
        """Called under the model lock with blocks already copied out of the pool: never waits. Returns what the
        host tier took and dropped (the disk tier's changes come from the writer, on_disk_change)."""
        stored: list[TierBlock] = []
        removed: list[bytes] = []
        for b in blocks:
            if self.host is not None:
                new, gone = self.host.put(b)
                if new:
                    stored.append(b)
                removed.extend(gone)
            if self.disk is not None:
                try:
                    self._queue.put_nowait(b)
                except queue.Full:
                    self.dropped += 1
        return [TierChange(HostTier.medium, stored, removed)] if stored or removed else []

    def get(self, h: bytes) -> TierBlock | None:
        b = self.host.get(h) if self.host is not None else None
        if b is None and self.disk is not None:
            b = self.disk.get(h)
        return b

    def has(self, h: bytes) -> bool:
        return (self.host is not None and h in self.host) or (self.disk is not None and h in self.disk)

    def stats(self) -> list[TierStats]:
        out = []
        if self.host is not None:
            h = self.host
            out.append(TierStats(h.medium, len(h), h.bytes, h.hits, h.written, h.evicted, 0))
        if self.disk is not None:
            d = self.disk
            out.append(TierStats(d.medium, len(d), d.bytes, d.hits, d.written, d.evicted, d.corrupt, d.read_bytes,
                                 d.read_seconds, d.health.errors, d.health.writable, d.missing))
        return out

    def write_through(self, blocks: list[TierBlock], deadline: float) -> int:
        """Queues blocks for the disk writer, waiting for room until deadline (time.monotonic()); returns how many
        were queued (the first ones). For a shutdown's flush of the pool (executor_service/kv/tiers/flush.py), never a step: never
        call it holding the model lock (the writer takes it to announce what it wrote, so a full queue would
        never drain)."""
        for n, b in enumerate(blocks):
            try:
                self._queue.put(b, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                return n
        return len(blocks)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until every spill queued so far is written and announced (tests, benchmarks, shutdown); False
        when timeout_s passed first. Never call it holding the model lock: announcing takes it."""
        done = threading.Event()
        self._marker = done  # set before the marker is queued: the writer may reach it at once
        try:
            self._queue.put(TierBlock(b"", b"", "", b"", b""), timeout=timeout_s)  # a marker
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def _write_loop(self) -> None:
        assert self.disk is not None
        while True:
            batch = [self._queue.get()]
            while len(batch) < _WRITE_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            stored: list[TierBlock] = []
            removed: list[bytes] = []
            for b in batch:
                if b.hash:
                    new, gone = self.disk.put(b)
                    if new:
                        stored.append(b)
                    removed.extend(gone)
            if (stored or removed) and self.on_disk_change is not None:
                try:
                    self.on_disk_change(TierChange(DiskTier.medium, stored, removed))
                except Exception:  # never let the writer die: the blocks are written, only their events are lost
                    log.exception("disk tier: announcing written blocks failed")
            if any(not b.hash for b in batch):
                getattr(self, "_marker", threading.Event()).set()
