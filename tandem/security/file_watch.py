"""Noticing that files changed, cheaply enough to ask on every TLS handshake or every request: their mtimes,
sizes and inodes are looked at no more than once per interval (a second by default), and a SIGHUP (force())
makes the next question look at once and answer "changed" whatever the stat says."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

CHECK_INTERVAL_S = 1.0
_Stamp = tuple[tuple[int, int, int], ...]


class FileWatch:
    """changed() is True once after any of `paths` was rewritten, replaced (a new inode: an atomic rename, a
    Kubernetes Secret update) or removed, or after force(). Thread-safe."""

    def __init__(self, paths: list[Path], interval_s: float = CHECK_INTERVAL_S) -> None:
        self.paths = list(paths)
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._stamp = self._read_stamp()
        self._checked = time.monotonic()
        self._forced = False

    def _read_stamp(self) -> _Stamp:
        stamps = []
        for p in self.paths:
            try:
                st = os.stat(p)
                stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:  # missing for now (mid-rotation): a change, read again next time
                stamps.append((-1, -1, -1))
        return tuple(stamps)

    def force(self) -> None:
        """The next changed() answers True (SIGHUP: reload now, even when the stat looks the same)."""
        with self._lock:
            self._forced = True

    def changed(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if not self._forced and now - self._checked < self._interval_s:
                return False
            self._checked = now
            stamp = self._read_stamp()
            changed = self._forced or stamp != self._stamp
            self._stamp, self._forced = stamp, False
            return changed
