"""KV tiers under the prefix cache (docs/kv-transfer.md, 'Tiers'): a full block the pool evicts is copied out
(under the model lock, at once: its slot is about to be rewritten) and kept in host memory (--kv-host-gb) and on
disk (--kv-disk-dir, --kv-disk-gb), written by a background thread, never on a step's path. A CreateCache whose
prefix misses the pool continues the match here and loads the blocks back (executor_service/kv/prefix_cache.py).

Disk layout: DIR/<16 hex of the KV fingerprint>/<block hash hex>.kvb, one file per block, so an executor only
ever sees blocks of its own model and KV layout, and restarting it reopens them (the index is the directory
listing, least recently used first by mtime). A file is: magic, CRC-32C of the rest, parent hash, adapter,
token ids, the block's bytes (executor_service/kv/block_bytes.py). A file that is truncated, corrupt or not ours is ignored,
counted and deleted. A full tier deletes its least recently used blocks.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from executor_service.kv.block_bytes import crc32c

log = logging.getLogger("tandem.executor.kv_tier")
MAGIC = b"TKVBLK1\n"
_HEAD = struct.Struct("<8sI")  # magic, CRC-32C of everything after it
SPILL_QUEUE = 4096  # blocks waiting for the writer; more are dropped (counted), never waited for
_WRITE_BATCH = 64  # blocks the writer writes before announcing them (one model-lock hold per batch)


@dataclass(frozen=True)
class TierBlock:
    """A block kept in a tier: its hash, what the prefix cache's index records of it, and its bytes."""

    hash: bytes
    parent: bytes  # b"" for a sequence's first block
    adapter: str
    token_ids: bytes  # uint32 little-endian
    data: bytes


def encode(b: TierBlock) -> bytes:
    ad = b.adapter.encode()
    body = struct.pack("<HHI", len(b.parent), len(ad), len(b.token_ids)) + b.parent + ad + b.token_ids + b.data
    return _HEAD.pack(MAGIC, crc32c(body)) + body


def decode(h: bytes, raw: bytes, data_bytes: int) -> TierBlock | None:
    """None when raw is not a whole, intact block file of this layout."""
    if len(raw) < _HEAD.size + 8:
        return None
    magic, crc = _HEAD.unpack_from(raw)
    body = raw[_HEAD.size:]
    if magic != MAGIC or crc32c(body) != crc:
        return None
    np_, na, nt = struct.unpack_from("<HHI", body)
    off = 8
    if len(body) != off + np_ + na + nt + data_bytes:
        return None
    parent = bytes(body[off:off + np_])
    adapter = bytes(body[off + np_:off + np_ + na]).decode(errors="replace")
    tokens = bytes(body[off + np_ + na:off + np_ + na + nt])
    return TierBlock(h, parent, adapter, tokens, bytes(body[off + np_ + na + nt:]))


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


class DiskTier:
    """Blocks in files under DIR/<fingerprint digest>/ (see the module docstring)."""

    medium = "DISK"

    def __init__(self, root: Path, max_bytes: int, fingerprint: str, data_bytes: int) -> None:
        self.dir = root / hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "FINGERPRINT").write_text(fingerprint + "\n")
        self.max_bytes = max_bytes
        self.data_bytes = data_bytes
        self._guard = threading.Lock()
        # hash -> (file size, the block without its data), least recently used first: the metadata is what KV
        # events announce (a router matches prompts by token ids)
        self._files: OrderedDict[bytes, tuple[int, TierBlock]] = OrderedDict()
        self._bytes = 0
        self.hits = self.corrupt = self.written = self.evicted = 0
        self.read_bytes = 0  # bytes of the blocks loaded back (what the read bandwidth is measured on)
        self.read_seconds = 0.0
        self._reopen()

    def _path(self, h: bytes) -> Path:
        return self.dir / f"{h.hex()}.kvb"

    def _reopen(self) -> None:
        found = []
        for p in self.dir.iterdir():
            if p.suffix == ".tmp":
                p.unlink(missing_ok=True)  # a write cut short by a crash
                continue
            if p.suffix != ".kvb":
                continue
            try:
                h, st = bytes.fromhex(p.stem), p.stat()
            except (ValueError, OSError):
                self.corrupt += 1
                continue
            meta = _read_meta(p, h, st.st_size, self.data_bytes) if len(h) == 16 else None
            if meta is None:  # the whole file is checked (CRC) when it is loaded; here only its size and head
                self.corrupt += 1
                p.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime, h, st.st_size, meta))
        for _, h, size, meta in sorted(found, key=lambda f: f[0]):
            self._files[h] = (size, meta)
            self._bytes += size
        self._evict()
        if found:
            log.info("disk tier %s: %d blocks (%.1f MiB) reopened", self.dir.name, len(self._files), self._bytes / 2**20)

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, h: bytes) -> bool:
        return h in self._files

    def put(self, b: TierBlock) -> tuple[bool, list[bytes]]:
        """Writes the block's file (on the writer thread); (whether it is new here, the hashes evicted)."""
        if b.hash in self._files:
            return False, []
        raw = encode(b)
        tmp = self._path(b.hash).with_suffix(".tmp")
        try:
            tmp.write_bytes(raw)
            os.replace(tmp, self._path(b.hash))
        except OSError as exc:
            log.warning("disk tier: cannot write a block (%s); it is not kept", exc.strerror)
            tmp.unlink(missing_ok=True)
            return False, []
        with self._guard:
            self._files[b.hash] = (len(raw), TierBlock(b.hash, b.parent, b.adapter, b.token_ids, b""))
            self._bytes += len(raw)
            self.written += 1
            gone = self._evict()
            return b.hash in self._files, gone

    def _evict(self) -> list[bytes]:
        gone = []
        while self._bytes > self.max_bytes and self._files:
            h, (size, _) = self._files.popitem(last=False)
            self._bytes -= size
            self._path(h).unlink(missing_ok=True)
            gone.append(h)
        self.evicted += len(gone)
        return gone

    def get(self, h: bytes) -> TierBlock | None:
        with self._guard:
            if h not in self._files:
                return None
            self._files.move_to_end(h)
        path = self._path(h)
        start = time.perf_counter()
        try:
            raw = path.read_bytes()
        except OSError:
            raw = b""
        b = decode(h, raw, self.data_bytes)
        if b is None:  # corrupt or truncated: never served, counted, gone
            with self._guard:
                self.corrupt += 1
                self._bytes -= self._files.pop(h, (0, None))[0]
            path.unlink(missing_ok=True)
            return None
        self.hits += 1
        self.read_bytes += len(raw)
        self.read_seconds += time.perf_counter() - start  # the read and the CRC check
        os.utime(path)  # least recently used order survives a restart
        return b

    def touch(self, hashes: list[bytes]) -> None:
        """Marks these blocks most recently used, in this order (their files' mtime too: a restart reopens the
        index in that order)."""
        for h in hashes:
            with self._guard:
                if h not in self._files:
                    continue
                self._files.move_to_end(h)
            try:
                os.utime(self._path(h))
            except OSError:
                pass  # deleted meanwhile: the next reopen drops it

    def metas(self) -> list[TierBlock]:
        """Every block held, without its data (least recently used first)."""
        with self._guard:
            return [m for _, m in self._files.values()]

    @property
    def bytes(self) -> int:
        return self._bytes


def _read_meta(p: Path, h: bytes, size: int, data_bytes: int) -> TierBlock | None:
    """A block file's parent, adapter and token ids (not its data), or None when its head is not ours or its size
    is not what its head says (truncated)."""
    if size < _HEAD.size + 8 + data_bytes:
        return None
    try:
        with p.open("rb") as f:
            head = f.read(_HEAD.size + 8)
            if len(head) < _HEAD.size + 8 or head[:len(MAGIC)] != MAGIC:
                return None
            np_, na, nt = struct.unpack_from("<HHI", head, _HEAD.size)
            rest = f.read(np_ + na + nt)
    except OSError:
        return None
    if len(rest) != np_ + na + nt or np_ not in (0, 16) or nt % 4 or size != _HEAD.size + 8 + np_ + na + nt + data_bytes:
        return None
    return TierBlock(h, rest[:np_], rest[np_:np_ + na].decode(errors="replace"), rest[np_ + na:], b"")


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
                                 d.read_seconds))
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
