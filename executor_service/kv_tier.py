"""KV tiers under the prefix cache (docs/kv-transfer.md, 'Tiers'): a full block the pool evicts is copied out
(under the model lock, at once: its slot is about to be rewritten) and kept in host memory (--kv-host-gb) and on
disk (--kv-disk-dir, --kv-disk-gb), written by a background thread, never on a step's path. A CreateCache whose
prefix misses the pool continues the match here and loads the blocks back (prefix_cache.py).

Disk layout: DIR/<16 hex of the KV fingerprint>/<block hash hex>.kvb, one file per block, so an executor only
ever sees blocks of its own model and KV layout, and restarting it reopens them (the index is the directory
listing, least recently used first by mtime). A file is: magic, CRC-32C of the rest, parent hash, adapter,
token ids, the block's bytes (kv_block_bytes.py). A file that is truncated, corrupt or not ours is ignored,
counted and deleted. A full tier deletes its least recently used blocks.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from executor_service.kv_block_bytes import crc32c

log = logging.getLogger("tandem.executor.kv_tier")
MAGIC = b"TKVBLK1\n"
_HEAD = struct.Struct("<8sI")  # magic, CRC-32C of everything after it
SPILL_QUEUE = 4096  # blocks waiting for the writer; more are dropped (counted), never waited for


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
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, b: TierBlock) -> list[bytes]:
        """Returns the hashes evicted to make room."""
        gone = []
        with self._guard:
            if b.hash in self._blocks:
                self._blocks.move_to_end(b.hash)
                return gone
            self._blocks[b.hash] = b
            self._bytes += len(b.data)
            while self._bytes > self.max_bytes and self._blocks:
                h, old = self._blocks.popitem(last=False)
                self._bytes -= len(old.data)
                gone.append(h)
        return gone

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
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, least recently used first
        self._bytes = 0
        self.hits = self.corrupt = self.written = 0
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
            if len(h) != 16 or st.st_size < _HEAD.size + 8 + self.data_bytes:
                self.corrupt += 1
                p.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime, h, st.st_size))
        for _, h, size in sorted(found):
            self._files[h] = size
            self._bytes += size
        self._evict()
        if found:
            log.info("disk tier %s: %d blocks (%.1f MiB) reopened", self.dir.name, len(self._files), self._bytes / 2**20)

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, h: bytes) -> bool:
        return h in self._files

    def put(self, b: TierBlock) -> list[bytes]:
        """Writes the block's file (on the writer thread); returns the hashes evicted to make room."""
        if b.hash in self._files:
            return []
        raw = encode(b)
        tmp = self._path(b.hash).with_suffix(".tmp")
        try:
            tmp.write_bytes(raw)
            os.replace(tmp, self._path(b.hash))
        except OSError as exc:
            log.warning("disk tier: cannot write a block (%s); it is not kept", exc.strerror)
            tmp.unlink(missing_ok=True)
            return []
        with self._guard:
            self._files[b.hash] = len(raw)
            self._bytes += len(raw)
            self.written += 1
            return self._evict()

    def _evict(self) -> list[bytes]:
        gone = []
        while self._bytes > self.max_bytes and self._files:
            h, size = self._files.popitem(last=False)
            self._bytes -= size
            self._path(h).unlink(missing_ok=True)
            gone.append(h)
        return gone

    def get(self, h: bytes) -> TierBlock | None:
        with self._guard:
            if h not in self._files:
                return None
            self._files.move_to_end(h)
        path = self._path(h)
        try:
            raw = path.read_bytes()
        except OSError:
            raw = b""
        b = decode(h, raw, self.data_bytes)
        if b is None:  # corrupt or truncated: never served, counted, gone
            with self._guard:
                self.corrupt += 1
                self._bytes -= self._files.pop(h, 0)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # least recently used order survives a restart
        self.hits += 1
        return b

    @property
    def bytes(self) -> int:
        return self._bytes


class TierStore:
    """The host and disk tiers together, and the writer thread that fills them."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None) -> None:
        self.host, self.disk = host, disk
        self.dropped = 0  # spills not kept because the writer was too far behind
        self._queue: queue.Queue[TierBlock | None] = queue.Queue(SPILL_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    def spill(self, blocks: list[TierBlock]) -> None:
        """Called under the model lock with blocks already copied out of the pool: never waits."""
        for b in blocks:
            if self.host is not None:
                self.host.put(b)
            if self.disk is not None:
                try:
                    self._queue.put_nowait(b)
                except queue.Full:
                    self.dropped += 1

    def get(self, h: bytes) -> TierBlock | None:
        b = self.host.get(h) if self.host is not None else None
        if b is None and self.disk is not None:
            b = self.disk.get(h)
        return b

    def has(self, h: bytes) -> bool:
        return (self.host is not None and h in self.host._blocks) or (self.disk is not None and h in self.disk)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Waits until every spill queued so far is written (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(TierBlock(b"", b"", "", b"", b""), timeout=timeout_s)  # a marker
        self._marker = done
        done.wait(timeout_s)

    def _write_loop(self) -> None:
        while True:
            b = self._queue.get()
            if not b.hash:
                getattr(self, "_marker", threading.Event()).set()
                continue
            self.disk.put(b)
