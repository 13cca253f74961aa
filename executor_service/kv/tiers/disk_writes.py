"""How the disk tier writes a block file, and what it does when the disk refuses (docs/kv-transfer.md, 'Disk
faults'). Separate from the tier's index (executor_service/kv/tiers/disk.py): this is the one place that decides
durability (--kv-disk-fsync) and the pause after a failed write.

A write goes to a temporary name and is renamed, so a crash leaves no half block. Without fsync the rename may
reach the disk before the data: a power loss (not a process crash) can leave recent files empty or short; the
tier's size and CRC checks drop them when it reopens, so a power loss costs recomputing recent blocks, never a
wrong one. With fsync the file's data is made durable before the rename and the directory after it.

A write the disk refuses (full, read-only, I/O error) stops the tier's writes: for the next RETRY_S seconds the
blocks spilled are not written (counted, never waited for), then one write is tried again. The outage is logged
once when it starts and once when writes resume, never per block.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("tandem.executor.kv_tier")
RETRY_S = 1.0  # after a refused write, the time without writes before trying again (a write costs little)
REFUSALS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is spent",
            errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted", errno.EIO: "an I/O error"}
NOT_FOR_USE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)  # at start: the directory cannot serve


def reason(exc: OSError) -> str:
    """What a refused write says to an operator (no path: the flag names it)."""
    return REFUSALS.get(exc.errno or 0, exc.strerror or type(exc).__name__)


def write_file(path: Path, raw: bytes, fsync: bool) -> None:
    """raw into path, whole or not at all (a temporary name renamed); with fsync, durable when it returns."""
    tmp = path.with_suffix(".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        sync_dir(path.parent)


def sync_dir(d: Path) -> None:
    """Makes a rename (or a create, an unlink) in d durable."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteHealth:
    """Whether the tier writes now; counts the blocks a refused disk cost. Used on the writer thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.stopped_reason: str | None = None  # None: writes go
        self._retry_at = 0.0
        self.errors = 0  # blocks not written because the disk refused (a write that failed, or skipped meanwhile)
        self._since_stop = 0

    @property
    def writable(self) -> bool:
        return self.stopped_reason is None

    def may_write(self) -> bool:
        """False while writes are stopped and the retry time has not come (the block is counted as not written)."""
        if self.stopped_reason is None or self._clock() >= self._retry_at:
            return True
        self.errors += 1
        self._since_stop += 1
        return False

    def refused(self, exc: OSError) -> None:
        self.errors += 1
        self._since_stop += 1
        self._retry_at = self._clock() + RETRY_S
        if self.stopped_reason is None:
            self.stopped_reason = reason(exc)
            log.warning("disk tier: writes stopped: %s (errno %s); evicted blocks are kept in the host tier if any, "
                        "else recomputed when needed; serving goes on; retrying every %.0f s", self.stopped_reason,
                        errno.errorcode.get(exc.errno or 0, "?"), RETRY_S)

    def stop(self, why: str) -> None:
        """Writes stopped from the start (a full disk when the tier opened)."""
        self.stopped_reason = why
        self._retry_at = self._clock() + RETRY_S
        log.warning("disk tier: writes stopped at start: %s; retrying every %.0f s", why, RETRY_S)

    def succeeded(self) -> None:
        if self.stopped_reason is not None:
            log.info("disk tier: writes resumed (%s before); %d blocks were not written meanwhile",
                        self.stopped_reason, self._since_stop)
            self.stopped_reason = None
            self._since_stop = 0
