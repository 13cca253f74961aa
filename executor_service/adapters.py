"""The executor's LoRA adapters: loading confined to --adapter-root, validation against the base model, and
an LRU of at most --max-adapters-on-device adapters whose weights sit on the device (the rest wait in host
memory and move back on first use).

Error messages name an adapter directory as the client gave it (relative to the root when it lies under
it), never resolved: the resolved path would tell a client where the root and its links lead on the host.
The registry's own lock guards its table of adapters, so listings never wait for a model call; loading,
unloading and moving weights happen under the executor's model lock."""
from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from executor_service.types import AdapterInfo
from models.config import ModelConfig
from tandem.errors import AdapterInUse, AdapterNotFound, InvalidRequest, PermissionDenied
from models.lora.weights import CONFIG_FILE, WEIGHTS_FILE, LoraWeights, read_adapter

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_PATH_BYTES = 4096  # PATH_MAX on Linux: a longer path cannot name a directory


@dataclass
class _Adapter:
    name: str
    path: Path  # resolved (AdapterInfo.path)
    label: str  # as the client gave it: what messages show
    host: LoraWeights  # CPU copy, always kept
    digest: str  # of its config and weights files: the prefix cache keys its KV blocks by it
    device: LoraWeights | None = None  # on the executor's device while in the LRU
    requests: int = 0
    loads: int = 0
    evictions: int = 0


class AdapterRegistry:
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, root: Path | None,
                 max_on_device: int, max_rank: int) -> None:
        if max_on_device < 1 or max_rank < 1:
            raise ValueError(f"--max-adapters-on-device and --max-lora-rank must be >= 1, got {max_on_device} and "
                             f"{max_rank}")
        self._cfg, self._device, self._dtype = cfg, device, dtype
        self.root = root.resolve() if root is not None else None
        self.max_on_device = max_on_device
        self.max_rank = max_rank
        self._guard = threading.Lock()  # the membership of _adapters (listings read it from RPC threads)
        self._adapters: dict[str, _Adapter] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # names on the device, least recently used first
        self.moves = 0  # loads to + evictions from the device so far (lets callers invalidate derived copies)

    # ----------------------------------------------------------------- load / unload
    def load(self, name: str, path: str | Path, trusted: bool = False) -> None:
        """Validates and loads an adapter (host memory; it moves to the device when first used). trusted:
        an operator's --adapter flag, allowed without --adapter-root (never a client's request)."""
        if not _NAME.fullmatch(name or ""):
            raise InvalidRequest(f"adapter {{field}} {name!r} must be 1-64 characters of A-Z a-z 0-9 _ . -", "name")
        if name in self._adapters:
            raise AdapterInUse(f"adapter {name!r} is already loaded (from {self._adapters[name].label!r}); "
                               "unload it first or pick another name")
        _check_path(str(path))
        label = self._label(Path(path))
        try:  # a name too long for the file system, a symbolic link loop: the path's fault, not the server's
            resolved = self._confine(Path(path), label, trusted)
            weights = read_adapter(resolved, self._cfg, self._dtype, self.max_rank, label=label)
            digest = _files_digest(resolved / CONFIG_FILE, resolved / WEIGHTS_FILE)
        except (OSError, RuntimeError) as exc:
            if not isinstance(exc, OSError) and "symlink loop" not in str(exc).lower():
                raise
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "a symbolic link loop"
            raise InvalidRequest(f"adapter {{field}} {label!r} cannot be read: {why}", "path") from exc
        with self._guard:
            self._adapters[name] = _Adapter(name, resolved, label, weights, digest)

    def unload(self, name: str) -> None:
        self.get(name)
        with self._guard:
            del self._adapters[name]
        self._lru.pop(name, None)

    def get(self, name: str, field: str | None = None) -> _Adapter:
        """field: the request field that named it, for the error (a proto path, tandem.errors.TandemError)."""
        adapter = self._adapters.get(name)
        if adapter is None:
            loaded = ", ".join(self.names()) or "none"
            what = "{field}" if field else "adapter"
            raise AdapterNotFound(f"{what} {name!r} is not loaded (loaded: {loaded}); LoadAdapter it first", field)
        return adapter

    def digest(self, name: str) -> str:
        """The adapter's files digest ("" for the base model)."""
        return self.get(name).digest if name else ""

    def names(self) -> tuple[str, ...]:
        with self._guard:
            return tuple(sorted(self._adapters))

    # ----------------------------------------------------------------- use
    def on_device(self, names: set[str]) -> dict[str, LoraWeights]:
        """Device weights for the adapters of one batch, moving them in (and least recently used others out)
        as needed. The caller has checked len(names) <= max_on_device."""
        for name in names:
            a = self.get(name)
            if a.device is None:
                while len(self._lru) >= self.max_on_device:
                    victim = next(v for v in self._lru if v not in names)
                    self._evict(victim)
                a.device = a.host.to(self._device)
                a.loads += 1
                self.moves += 1
            self._lru[name] = None
            self._lru.move_to_end(name)
        return {n: self._adapters[n].device for n in names}

    def count_request(self, name: str) -> None:
        self._adapters[name].requests += 1

    def infos(self, caches_per_adapter: dict[str, int]) -> list[AdapterInfo]:
        with self._guard:
            adapters = list(self._adapters.values())
        return [AdapterInfo(a.name, str(a.path), a.host.rank, a.host.targets, a.device is not None,
                            caches_per_adapter.get(a.name, 0), a.requests, a.loads, a.evictions, a.digest)
                for a in sorted(adapters, key=lambda a: a.name)]

    # ----------------------------------------------------------------- internals
    def _evict(self, name: str) -> None:
        a = self._adapters[name]
        a.device = None  # the host copy stays; on CPU both were the same tensors
        a.evictions += 1
        self.moves += 1
        self._lru.pop(name)

    def _label(self, path: Path) -> str:
        if self.root is not None and path.is_absolute() and path.is_relative_to(self.root):
            return str(path.relative_to(self.root))
        return str(path)

    def _confine(self, path: Path, label: str, trusted: bool) -> Path:
        """The adapter directory, resolved; inside the root (symlinks followed) unless trusted without a root."""
        if self.root is None:
            if not trusted:
                raise PermissionDenied("loading adapters at run time is disabled: start the executor with "
                                       "--adapter-root DIR (adapters are then loaded from inside DIR only)")
            return path.resolve()
        resolved = (self.root / path).resolve()  # an absolute path replaces the root here
        files = [resolved, resolved / CONFIG_FILE, resolved / WEIGHTS_FILE]
        for f in files:  # each file too: a symlinked weights file must not lead outside either
            if not f.resolve().is_relative_to(self.root):
                raise PermissionDenied(f"adapter path {label!r} leads outside the adapter root (--adapter-root), "
                                       "through '..', an absolute path or a symbolic link; give a directory "
                                       "inside the root")
        return resolved


def _check_path(path: str) -> None:
    """What no directory can be named by, refused before the file system sees it (a NUL byte made
    Path.resolve() raise ValueError, an INTERNAL)."""
    if "\x00" in path:
        raise InvalidRequest("adapter {field} contains a NUL byte (\\x00), which no file name can hold; give a "
                             "directory inside the adapter root (--adapter-root)", "path")
    size = len(path.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH_BYTES:
        raise InvalidRequest(f"adapter {{field}} is {size} bytes long; at most {MAX_PATH_BYTES}", "path")


def _files_digest(*files: Path) -> str:
    """blake2b of the files' contents, 16 hex characters: the same adapter files give the same digest on any
    executor (so routers can compute block hashes), other weights another one."""
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        data = f.read_bytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
