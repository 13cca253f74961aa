"""The disk KV tier (--kv-disk-dir, --kv-disk-gb): evicted blocks kept as files, reopened after a restart.

Layout: DIR/<16 hex of the KV fingerprint>/<block hash hex>.kvb, one file per block (executor_service/kv/tiers/
block_file.py), so an executor only ever sees blocks of its own model and KV layout, and restarting it reopens
them (the index is the directory listing, least recently used first by mtime). A file that is truncated, corrupt
or not ours is ignored, counted and deleted. A full tier deletes its least recently used blocks. Each file is
written whole under a temporary name and renamed, so a crash leaves no half block. Written by the store's
background thread (executor_service/kv/tiers/store.py), never on a step's path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from executor_service.kv.tiers.block_file import TierBlock, decode, encode, read_meta

log = logging.getLogger("tandem.executor.kv_tier")


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
            meta = read_meta(p, h, st.st_size, self.data_bytes) if len(h) == 16 else None
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

