"""CPU weights in transparent huge pages.

A decode step at batch 1 streams every weight once, and on a CPU the step is bound by memory bandwidth. With
4 KiB pages that stream crosses a page (and may miss the TLB) every 4 KiB; the float32 weights of a
safetensors checkpoint even stay in the file's page-cache mapping. Copied into one anonymous mapping advised
MADV_HUGEPAGE, the kernel backs it with 2 MiB pages (where /sys/kernel/mm/transparent_hugepage/enabled is
`madvise` or `always`; with `never` the advice is ignored and nothing changes but the copy). Measured on
SmolLM2-135M float32, 2 cores: the native decode step 10-15% faster.

What it can cost: some VMs back a huge page lazily on the host (free page reporting hands free 2 MiB blocks
back to the hypervisor), and there the first touch of each costs ~10 ms: ~5 s per 540 MB (measured on this
project's 2-core VM; ~0.2 s with 4 KiB pages). Mode "auto" (the default) therefore times the first
PROBE_BYTES it copies and, below MIN_RATE, leaves the rest of the weights where they are and says so; "on" keeps huge pages whatever they cost; "off" leaves the weights where they are.

The arena is carved into tensors 64-byte aligned; it lives as long as a tensor in it does (each holds the
arena's buffer), so weights dropped later (quantized away) free nothing until all of them go: move the
weights that stay, after quantizing. A weight copied in from the mapped checkpoint has its file pages released
(models/memory/mapped_pages.py): one resident copy, the arena's.
"""
from __future__ import annotations

import logging
import mmap
import time
from typing import Sequence

import torch
from torch import nn

from models.memory.mapped_pages import release_file_pages

log = logging.getLogger("tandem.models")
HUGE_PAGE = 2 << 20
_ALIGN = 64
MODES = ("auto", "on", "off")
PROBE_BYTES = 32 << 20  # "auto": copied into huge pages first, timed ...
MIN_RATE = 1e9  # ... bytes/s below which huge pages are given up (a lazily backed VM: ~0.1 GB/s)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class HugePageArena:
    """An anonymous private mapping of `nbytes` (+ one huge page, to start on a huge-page boundary), advised
    MADV_HUGEPAGE, handed out as tensors by copy(). mode "auto": times the first PROBE_BYTES copied and sets
    self.slow_rate (bytes/s) if they faulted in slower than MIN_RATE (the caller then stops copying)."""

    def __init__(self, nbytes: int, mode: str = "on") -> None:
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.advised = _advise(self._map)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # shares the mapping's memory
        self._start = self._offset = (-self._bytes.data_ptr()) % HUGE_PAGE
        self._end = self._offset + nbytes
        self._probing = self.advised and mode == "auto"
        self._probe_s = 0.0
        self.slow_rate: float | None = None  # bytes/s of the probe, when it gave huge pages up

    @property
    def used(self) -> int:
        return self._offset - self._start

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor t in the arena."""
        n = t.numel() * t.element_size()
        if self._offset + n > self._end:
            raise ValueError(f"the arena has {self._end - self._offset} bytes left, {n} asked")
        out = self._bytes[self._offset:self._offset + n].view(t.dtype).view(t.shape)
        started = time.perf_counter()
        out.copy_(t)
        self._offset += _round_up(n, _ALIGN)
        if self._probing:
            self._probe_s += time.perf_counter() - started
            self._check_probe()
        return out

    def _check_probe(self) -> None:
        done = self.used
        if done < PROBE_BYTES:
            return
        self._probing = False
        rate = done / max(self._probe_s, 1e-9)
        if rate < MIN_RATE:
            self.slow_rate = rate


def _advise(m: mmap.mmap) -> bool:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is None:
        return False
    try:
        m.madvise(advice)
    except OSError:  # a kernel without THP
        return False
    return True


def arena_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_round_up(t.numel() * t.element_size(), _ALIGN) for t in tensors)


def copy_to_huge_pages(tensors: Sequence[torch.Tensor], mode: str = "on") -> list[torch.Tensor]:
    """Copies of the tensors (CPU), all in one arena (mode: see the module docstring). With "auto" on a
    machine where huge pages fault in slowly, the tensors after the probe are returned as they are (no copy:
    4 KiB pages gain nothing worth the copy). Mode "off": the tensors themselves."""
    if mode not in MODES:
        raise ValueError(f"unknown --huge-pages {mode!r}; choose {', '.join(MODES)}")
    if mode == "off" or not tensors:
        return list(tensors)
    arena = HugePageArena(arena_bytes(tensors), mode)
    out = [t if arena.slow_rate is not None else arena.copy(t) for t in tensors]
    if arena.slow_rate is not None:
        log.info("transparent huge pages fault in slowly here (%.0f MB/s: a VM backing them lazily); of %.0f MB of "
                 "weights only the first %.0f MB went into them (--huge-pages on forces them all: a slower start, "
                 "a faster decode)", arena.slow_rate / 1e6, arena_bytes(tensors) / 1e6, arena.used / 1e6)
    else:
        log.info("%.0f MB of weights in one huge-page arena", arena.used / 1e6)
    return out


def move_parameters_to_huge_pages(model: nn.Module, mode: str = "auto", min_bytes: int = 1 << 16) -> int:
    """Moves every CPU parameter of at least min_bytes into one huge-page arena (tied parameters stay tied:
    each is one Parameter object). Returns the bytes moved (0 with mode "off" or nothing on the CPU)."""
    params = [p for p in model.parameters() if p.device.type == "cpu" and p.numel() * p.element_size() >= min_bytes
              and p.untyped_storage().nbytes() >= p.numel() * p.element_size()]  # (not a packed weight's stand-in)
    moved = 0
    with torch.no_grad():
        for p, t in zip(params, copy_to_huge_pages([p.detach() for p in params], mode)):
            if t.data_ptr() != p.data_ptr():
                release_file_pages([p.detach()])  # a weight still in the mapped checkpoint: one copy, not two
                p.data = t
                moved += arena_bytes([t])
    return moved
