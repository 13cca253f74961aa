"""Zero-filled tensors that cost nothing until they are written: the KV pool's allocation.

`torch.zeros` on CPU writes every byte, so a 6 GB pool takes ~16 s to allocate on a 2-core machine and is
resident at once. An anonymous private memory mapping is zero by definition (the OS hands out zero pages)
and is committed page by page on first write: allocating it is instant, never-written slots read as exact
zeros (reads of an untouched page map the kernel's shared zero page and commit nothing), and resident memory
grows only as blocks are first used. Exact zeros matter: masked attention multiplies the values of
unwritten slots by a zero weight, and garbage such as NaN would poison every row that reads them.

The mapping is untyped bytes viewed as the wanted dtype, so float32, bfloat16 and float16 all work (numpy
has no bfloat16). It lives as long as the tensor (torch.frombuffer keeps a reference to it). Pages are
committed 4 KiB at a time (no MADV_HUGEPAGE: one KV block of one layer is a few KiB, and 2 MiB pages would
commit ~170 blocks' worth per layer on the first write).

CUDA keeps `torch.zeros`: device memory has no lazily committed zero pages, and the fill runs at device
bandwidth (a few GB in well under a second on a datacenter GPU; not measured here, no GPU on this machine).
"""
from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A contiguous zero tensor of `shape` and `dtype` on `device`. On CPU its memory is an anonymous mapping,
    committed only where it is written; elsewhere it is `torch.zeros`. Raises OSError with the size and the
    flags to lower when the OS refuses the mapping."""
    device = torch.device(device)
    numel = math.prod(shape)
    if device.type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)  # CUDA: a device fill is fast (see above)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        if hasattr(mmap, "MAP_ANONYMOUS"):  # POSIX: private, so a fork would not share the pool's writes
            buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:  # Windows: an anonymous mapping backed by the paging file, demand-zero as well
            buffer = mmap.mmap(-1, nbytes)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot reserve {nbytes / 2**30:.2f} GiB of memory for the KV pool "
                                 f"({exc.strerror}); pass a smaller --kv-blocks or --kv-memory-fraction") from None
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
