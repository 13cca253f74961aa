"""Giving back the pages of weights that were copied elsewhere, so that each weight is resident once.

The loader maps safetensors files (models/loader.py): a weight used as it is stays a view of the file's pages,
which count in the process's RSS once read, and once only (they are the page cache's). A weight that is copied
instead (q/k/v fused into one tensor, a dtype conversion, the huge-page arena, oneDNN's packed layout) leaves
its source pages resident for as long as the file's mapping lives, which is as long as any tensor of that file
does: a second copy. `release_file_pages` advises the kernel that those pages are not needed (MADV_DONTNEED):
a file mapping's clean pages drop out of the process (they stay in the page cache, reclaimable) and would
fault in again from the file, unchanged, were they ever read. Only whole pages inside a tensor, and only in
file-backed mappings, are released: anonymous memory would read back as zeros.

`trim_heap` hands the C heap's free pages back (glibc's malloc_trim): tensors freed after a copy (of under
glibc's mmap threshold, up to 32 MiB) otherwise stay in the heap's free lists, resident.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
from typing import Iterable

import torch

log = logging.getLogger("tandem.models")
_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None = None


def _c_library() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name, use_errno=True) if name else None
        except OSError:
            return None
    return _libc


def file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of regular files (/proc/self/maps; [] where there is none)."""
    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[4] != "0" and parts[5].startswith("/"):  # an inode and a path
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    spans.append((start, end))
    except OSError:
        return []
    return spans


def in_mappings(t: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    """Whether CPU tensor t lies inside one of the spans (file_mappings(): read-only file pages, not to write)."""
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    return any(s <= begin and end <= e for s, e in spans)


def release_file_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Drops from this process the whole pages inside each CPU tensor that lies in a file mapping (the caller
    will not read it again: it made a copy). Returns the bytes released (0 off Linux)."""
    libc = _c_library()
    advice = getattr(mmap, "MADV_DONTNEED", None)
    todo = [t for t in tensors if t.device.type == "cpu" and t.numel() > 0 and t.is_contiguous()]
    if libc is None or advice is None or not todo:
        return 0
    spans = file_mappings()
    released = 0
    for t in todo:
        begin = t.data_ptr()
        end = begin + t.numel() * t.element_size()
        first, last = -(-begin // _PAGE) * _PAGE, end // _PAGE * _PAGE  # whole pages only
        if last <= first or not any(s <= begin and end <= e for s, e in spans):
            continue
        if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), advice) == 0:
            released += last - first
    return released


def trim_heap() -> None:
    """Returns the C heap's free pages to the system (glibc; a no-op elsewhere)."""
    libc = _c_library()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)
