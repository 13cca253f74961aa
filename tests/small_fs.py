"""Real small file systems for disk-fault tests: a tmpfs of a given size mounted on a test's directory (a full
disk is a real ENOSPC from the kernel, a read-only one a real EROFS, even for root, who ignores chmod).

Mounting needs CAP_SYS_ADMIN: the suite runs as root on its machine (CI included). Where mount(8) is refused
(not root, a container without the capability), can_mount() says why and the tests skip with that reason; the
alternatives (a user namespace: the executor would have to start inside it; RLIMIT_FSIZE: EFBIG, not ENOSPC, and
no read-only case) would test something else than what an operator meets.
"""
from __future__ import annotations

import errno
import functools
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


@functools.lru_cache(maxsize=1)
def mount_refused() -> str | None:
    """None when this process may mount a tmpfs, else why not (for pytest.skip)."""
    with tempfile.TemporaryDirectory() as d:
        try:
            r = _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", d)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"cannot run mount(8): {exc}"
        if r.returncode != 0:
            return f"mount -t tmpfs refused (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}"
        subprocess.run(["umount", d], capture_output=True, timeout=30)
    return None


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount(8) syntax: 1m, 512k) mounted on path (made if missing), unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    r = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    if r.returncode != 0:
        raise OSError(f"mount -t tmpfs on {path}: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)  # lazy: an open file may hold it


def remount(path: Path, options: str) -> None:
    """Remounts the tmpfs on path with options ("ro", "rw")."""
    r = _mount("-o", f"remount,{options}", str(path))
    if r.returncode != 0:
        raise OSError(f"mount -o remount,{options} {path}: {r.stderr.strip()}")


def fill(path: Path) -> Path:
    """A file in path's file system that takes all of its free room (written until ENOSPC); delete it to free it."""
    filler = path / "filler"
    chunk = b"\0" * 4096
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler
