"""Giving back the pages of weights that were copied elsewhere, so that each weight is resident once.

The loader maps safetensors files (models/loader.py): a weight used as it is stays a view of the file's pages,
which count in the process's RSS once read, and once only (they are the page cache's). A weight that is copied
instead (q/k/v fused into one tensor, a dtype conversion, the huge-page arena, oneDNN's packed layout) leaves
its source pages resident for as long as the file's mapping lives, which is as long as any tensor of that file
does: a second copy. `release_file_pages` advises the kernel that those pages are not needed (MADV_DONTNEED):
a file mapping's clean pages drop out of the process (they stay in the page cache, reclaimable) and would
fault in again from the file, unchanged, were they ever read. Only whole pages inside a tensor, and only in
file-backed mappings, are released: anonymous memory would read back as zeros.

Which addresses are file mappings is read from /proc/self/maps (a few milliseconds in a process with many
libraries); a loop that releases many weights reads it once (`mappings_as_of_now`, or the spans passed in).

`trim_heap` hands the C heap's free pages back (glibc's malloc_trim): tensors freed after a copy (of under
glibc's mmap threshold, up to 32 MiB) otherwise stay in the heap's free lists, resident.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import threading
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

log = logging.getLogger("tandem.models")
_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None = None
_snapshot = threading.local()  # .spans: file_mappings() read when this thread's mappings_as_of_now() began


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


@contextmanager
def mappings_as_of_now() -> Iterator[None]:
    """Inside the block, this thread's release_file_pages reads /proc/self/maps once (here), not once a call.
    Only for tensors that exist when the block begins: their memory cannot move while they live, so it lies in a
    file mapping inside the block exactly when it did here. (A tensor made inside the block could land where a
    mapping read here has since gone, and anonymous pages released read back as zeros.)"""
    outer = getattr(_snapshot, "spans", None)
    _snapshot.spans = file_mappings()
    try:
        yield
    finally:
        _snapshot.spans = outer


def release_file_pages(tensors: Iterable[torch.Tensor], spans: list[tuple[int, int]] | None = None) -> int:
    """Drops from this process the whole pages inside each CPU tensor that lies in a file mapping (the caller
    will not read it again: it made a copy). spans: file_mappings() as read by the caller after the tensors'
    files were mapped (default: mappings_as_of_now's, else read now). Returns the bytes released (0 off Linux)."""
    libc = _c_library()
    advice = getattr(mmap, "MADV_DONTNEED", None)
    todo = [t for t in tensors if t.device.type == "cpu" and t.numel() > 0 and t.is_contiguous()]
    if libc is None or advice is None or not todo:
        return 0
    if spans is None:
        spans = getattr(_snapshot, "spans", None)
    if spans is None:
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
