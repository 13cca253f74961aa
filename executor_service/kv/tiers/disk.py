"""The disk KV tier (--kv-disk-dir, --kv-disk-gb): evicted blocks kept as files, reopened after a restart.

Layout: DIR/<16 hex of the KV fingerprint>/<block hash hex>.kvb, one file per block (executor_service/kv/tiers/
block_file.py), so an executor only ever sees blocks of its own model and KV layout, and restarting it reopens
them (the index is the directory listing, least recently used first by mtime). A file that is truncated, corrupt
or not ours is ignored, counted and deleted. A full tier deletes its least recently used blocks. Written by the
store's background thread (executor_service/kv/tiers/store.py), never on a step's path; how a file is written and
what a refused write does: executor_service/kv/tiers/disk_writes.py.

Faults (docs/kv-transfer.md, 'Disk faults'): a directory that cannot be written at start (read-only, no
permission, not a directory) refuses the start (DiskTierUnusable); a full disk stops the writes, not the
serving; a block file deleted under the executor is a miss (dropped from the index, counted as missing); the
whole directory deleted drops the whole index and the next write recreates it.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from executor_service.kv.tiers.block_file import TierBlock, decode, encode, read_meta
from executor_service.kv.tiers.disk_writes import NOT_FOR_USE, WriteHealth, reason, write_file

log = logging.getLogger("tandem.executor.kv_tier")


class DiskTierUnusable(ValueError):
    """--kv-disk-dir cannot hold a tier (read-only, no permission, not a directory): the executor refuses to
    start (a ValueError: its command line is wrong for this machine)."""


def check_dir(d: Path) -> str | None:
    """Makes d (and its parents) and writes a file there: raises DiskTierUnusable when it never can (read-only,
    no permission, not a directory), returns why writes must wait when the disk is full, else None. The executor
    calls it on --kv-disk-dir before loading the model, so a wrong directory fails the start at once."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".probe.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        if exc.errno in NOT_FOR_USE or not d.is_dir():
            raise DiskTierUnusable(f"--kv-disk-dir cannot hold the disk tier: {reason(exc)} (errno "
                                   f"{errno.errorcode.get(exc.errno or 0, '?')}); give a writable directory, or "
                                   "leave --kv-disk-dir out to run without a disk tier") from exc
        return reason(exc)
    return None


class DiskTier:
    """Blocks in files under DIR/<fingerprint digest>/ (see the module docstring)."""

    medium = "DISK"

    def __init__(self, root: Path, max_bytes: int, fingerprint: str, data_bytes: int, fsync: bool = False) -> None:
        self.dir = root / hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.data_bytes = data_bytes
        self.fsync = fsync  # --kv-disk-fsync: every file (and its directory entry) durable once written
        self.health = WriteHealth()
        self.missing = 0  # block files found gone (deleted under the executor): dropped from the index
        self._removed: list[bytes] = []  # hashes dropped on a read, for the link to announce (take_removed)
        self._guard = threading.Lock()
        # hash -> (file size, the block without its data), least recently used first: the metadata is what KV
        # events announce (a router matches prompts by token ids)
        self._files: OrderedDict[bytes, tuple[int, TierBlock]] = OrderedDict()
        self._bytes = 0
        self.hits = self.corrupt = self.written = self.evicted = 0
        self.read_bytes = 0  # bytes of the blocks loaded back (what the read bandwidth is measured on)
        self.read_seconds = 0.0
        self._open_dir()
        self._reopen()

    def _open_dir(self) -> None:
        """Creates the directory and checks that it takes a file; refuses a directory that never will."""
        why = check_dir(self.dir)
        if why is None:
            try:
                self._make_dir()
            except OSError as exc:  # (a full disk can refuse the FINGERPRINT file)
                why = reason(exc)
        if why is not None:
            self.health.stop(why)  # a full disk: the tier opens, its writes wait for room

    def _make_dir(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        mark = self.dir / "FINGERPRINT"
        try:
            if mark.read_text() == self.fingerprint + "\n":
                return
        except OSError:
            pass
        mark.write_text(self.fingerprint + "\n")

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
        """Writes the block's file (on the writer thread); (whether it is new here, the hashes dropped: evicted for
        room, or gone with a deleted directory)."""
        if b.hash in self._files or not self.health.may_write():
            return False, []
        raw = encode(b)
        gone: list[bytes] = []
        try:
            try:
                write_file(self._path(b.hash), raw, self.fsync)
            except FileNotFoundError:
                if self.dir.is_dir():
                    raise
                gone = self._lost_dir()  # deleted under us: start again with an empty tier
                self._make_dir()
                write_file(self._path(b.hash), raw, self.fsync)
        except OSError as exc:
            self.health.refused(exc)
            return False, gone
        self.health.succeeded()
        with self._guard:
            self._files[b.hash] = (len(raw), TierBlock(b.hash, b.parent, b.adapter, b.token_ids, b""))
            self._bytes += len(raw)
            self.written += 1
            gone += self._evict()
            return b.hash in self._files, gone

    def _lost_dir(self) -> list[bytes]:
        """The directory is gone: every block of the index with it (returned, to be announced as removed)."""
        with self._guard:
            gone = list(self._files)
            self._files.clear()
            self._bytes = 0
            self.missing += len(gone)
        log.warning("disk tier: its directory was deleted under the executor: %d blocks dropped from the index; "
                    "recreated by the next write", len(gone))
        return gone

    def _evict(self) -> list[bytes]:
        gone = []
        while self._bytes > self.max_bytes and self._files:
            h, (size, _) = self._files.popitem(last=False)
            self._bytes -= size
            try:
                self._path(h).unlink(missing_ok=True)
            except OSError:
                pass  # (a disk gone read-only: the file stays, out of the index; a reopen counts it again)
            gone.append(h)
        self.evicted += len(gone)
        return gone

    def get(self, h: bytes) -> TierBlock | None:
        """The block, or None: not held, or its file was found corrupt or gone (dropped from the index then; the
        hashes dropped wait in take_removed())."""
        with self._guard:
            if h not in self._files:
                return None
            self._files.move_to_end(h)
        path = self._path(h)
        start = time.perf_counter()
        try:
            raw = path.read_bytes()
        except FileNotFoundError:  # deleted under us: a miss, the prompt recomputes it
            self._drop(h, missing=True)
            if not self.dir.is_dir():
                lost = self._lost_dir()
                with self._guard:
                    self._removed.extend(lost)
            return None
        except OSError:
            raw = b""
        b = decode(h, raw, self.data_bytes)
        if b is None:  # corrupt or truncated: never served, counted, gone
            self._drop(h, missing=False)
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
            return None
        self.hits += 1
        self.read_bytes += len(raw)
        self.read_seconds += time.perf_counter() - start  # the read and the CRC check
        try:
            os.utime(path)  # least recently used order survives a restart
        except OSError:
            pass  # deleted since the read, or a read-only disk: the order is only a hint
        return b

    def _drop(self, h: bytes, missing: bool) -> None:
        with self._guard:
            if h in self._files:
                self._bytes -= self._files.pop(h)[0]
                self._removed.append(h)
            if missing:
                self.missing += 1
            else:
                self.corrupt += 1

    def take_removed(self) -> list[bytes]:
        """Hashes get() dropped from the index since the last call (announced as removed by the link)."""
        with self._guard:
            out, self._removed = self._removed, []
            return out

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

