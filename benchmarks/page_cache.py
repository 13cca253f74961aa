"""The page cache of a model directory's files (Linux): how much of them it holds, and evicting them so a start
reads the weights from disk ("cold") without root's global /proc/sys/vm/drop_caches.

Eviction is fsync + `posix_fadvise(POSIX_FADV_DONTNEED)` per file: the kernel drops the file's clean, unmapped
pages (a page some process has mapped stays). Residency is measured with mincore(2) on a private mapping of the
file. Elsewhere (no fadvise or mincore) both answer None and the caller reports cold starts as unavailable.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_PAGE = mmap.PAGESIZE


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).rglob("*") if p.is_file())


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore  # noqa: B018  (raises AttributeError where the C library has none)
        return libc
    except (OSError, AttributeError):
        return None


def _resident_bytes(path: Path, libc: ctypes.CDLL) -> int | None:
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        # ACCESS_COPY: a private, writable view (ctypes needs a writable buffer for its address); nothing
        # is written, so no page is copied or read in.
        anchor = ctypes.c_char.from_buffer(mm)
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
                return None
            return min(size, sum(b & 1 for b in bytes(vec)) * _PAGE)
        finally:
            del anchor  # the mmap cannot close while ctypes holds its buffer


def cached_fraction(directory: Path) -> float | None:
    """Share of the directory's file bytes in the page cache now (0..1); None where it cannot be measured."""
    libc = _libc()
    if libc is None:
        return None
    total = resident = 0
    for path in _files(directory):
        try:
            got = _resident_bytes(path, libc)
        except (OSError, ValueError):
            return None
        if got is None:
            return None
        total += path.stat().st_size
        resident += got
    return resident / total if total else 1.0


def evict(directory: Path) -> bool:
    """Asks the kernel to drop the directory's files from the page cache; False where it cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in _files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a file just written) are not dropped: write them back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True
