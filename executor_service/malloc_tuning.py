"""How the executor bounds glibc malloc's share of its resident memory (docs/operations.md, 'Memory'): the number
of malloc arenas (--malloc-arena-max) and a trim when the model thread goes idle (--malloc-trim-s).

Why: torch's CPU tensors are plain malloc'd memory (c10's CPU allocator caches nothing), and so are protobuf
messages and gRPC buffers. glibc gives each thread that contends for the allocator its own arena, up to 8 per
core, and an arena keeps what it freed for reuse instead of returning it; tensors of many sizes (every batch
shape a step sees) leave free holes in them. Fewer arenas and a malloc_trim (which hands free pages back to the
kernel, in every arena) bound that part. Set once at start from the command line (never from the environment
at import); outside glibc (musl, macOS) both are skipped, logged.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("tandem.executor.memory")
M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)
DEFAULT_ARENA_MAX = 2  # the model thread and gRPC's threads; 0 = glibc's own default (8 per core)
DEFAULT_TRIM_S = 10.0  # at most one trim per this many seconds, when the model thread goes idle; 0 = never


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # glibc's, not musl's or macOS's
        return libc
    except (OSError, AttributeError):
        return None


def set_arena_max(n: int) -> bool:
    """Caps glibc's malloc arenas at n (0: leave glibc's default). Call before the server's threads start (arenas
    made before stay). False when this is not glibc or it refused (logged)."""
    if n < 0:
        raise ValueError(f"--malloc-arena-max must be >= 0, got {n}")
    if n == 0:
        return True
    libc = _libc()
    if libc is None or libc.mallopt(M_ARENA_MAX, n) != 1:
        log.warning("--malloc-arena-max %d: not applied (not glibc's malloc)", n)
        return False
    return True


class IdleTrim:
    """malloc_trim(0) when the model thread goes idle, at most once per interval_s (0: never). Called on the model
    thread after each call with how many calls wait; a trim takes a few ms (it walks the arenas), so it runs only
    when none waits."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"--malloc-trim-s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._libc = _libc() if interval_s > 0 else None
        self._next = clock() + interval_s
        self._guard = threading.Lock()
        self.trims = 0

    def after_call(self, waiting: int) -> None:
        if self._libc is None or waiting or self._clock() < self._next:
            return
        with self._guard:
            self._libc.malloc_trim(0)
            self.trims += 1
            self._next = self._clock() + self.interval_s
