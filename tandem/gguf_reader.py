"""A GGUF file's header read without decoding what is not asked for: the `gguf` package's GGUFReader turns
every value of every array into numpy views at open (measured 2.7 s for SmolLM2's 49k tokens and 49k merges,
more for 151k-token vocabularies), which the executor never reads. Here an array of strings is only walked
(its offset and length kept) until `value(key)` decodes it (0.03 s for SmolLM2's tokens, in plain Python).
Shared by the executor's loader (models/gguf/file.py: no tokenizer array decoded) and the scheduler's GGUF
tokenizer (scheduler/text/gguf_tokenizer.py: only the tokenizer's keys decoded).

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, metadata count u64; each metadata
entry: key (u64 length + UTF-8), value type u32, value (a string is u64 length + bytes; an array is item type
u32, count u64, items); each tensor: name, dims u32, dims x u64 (innermost first), ggml type u32, offset u64
from the data section, which starts at the next multiple of general.alignment (default 32). Torch-free.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# value type -> struct format of the scalars (GGUFValueType)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
           12: "<f8"}
DEFAULT_ALIGNMENT = 32


class GgufFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (the message says where and why)."""


@dataclass(frozen=True)
class LazyArray:
    """An array value not decoded yet: its item type, length and where its items start."""
    item_type: int
    count: int
    offset: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order: [rows, columns] for a matrix
    offset: int  # of its data, from the start of the file


class GgufHeader:
    """The header of the GGUF file at `path`: `metadata` (key -> value; arrays of strings, and arrays of more
    than `eager_items` items, as LazyArray until `value(key)` decodes them), `tensors` by name, and `data`:
    the whole file memory-mapped read-only (tensors are views of it). `decoded_arrays` counts the lazy arrays
    decoded so far."""

    def __init__(self, path: str | Path, eager_items: int = 64) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file
                raise GgufFormatError(f"cannot map it: {exc}") from None
        self.data = np.frombuffer(self._map, dtype=np.uint8)  # [file bytes]
        self._eager = eager_items
        self.decoded_arrays = 0
        if bytes(self._map[:4]) != MAGIC:
            raise GgufFormatError(f"bad magic {bytes(self._map[:4])!r} (not a GGUF file)")
        version, n_tensors, n_meta = self._unpack("<IQQ", 4)
        if version not in (2, 3):
            raise GgufFormatError(f"GGUF version {version} (big-endian, or not 2/3) is not supported")
        offset = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_meta):
            key, offset = self._string(offset)
            (kind,), offset = self._unpack("<I", offset), offset + 4
            self.metadata[key], offset = self._value(kind, offset)
        infos = []
        for _ in range(n_tensors):
            name, offset = self._string(offset)
            (dims,), offset = self._unpack("<I", offset), offset + 4
            shape = self._unpack(f"<{dims}Q", offset)
            offset += 8 * dims
            ggml_type, rel = self._unpack("<IQ", offset)
            offset += 12
            infos.append((name, ggml_type, tuple(reversed(shape)), rel))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise GgufFormatError(f"general.alignment={align} is not a power of two")
        start = -(-offset // align) * align
        self.tensors = {name: TensorInfo(name, t, shape, start + rel) for name, t, shape, rel in infos}
        if len(self.tensors) != len(infos):
            raise GgufFormatError("duplicate tensor names")

    def _unpack(self, fmt: str, offset: int) -> tuple:
        try:
            return struct.unpack_from(fmt, self._map, offset)
        except struct.error:
            raise GgufFormatError(f"truncated at byte {offset}") from None

    def _string(self, offset: int) -> tuple[str, int]:
        (n,) = self._unpack("<Q", offset)
        end = offset + 8 + n
        if end > len(self._map):
            raise GgufFormatError(f"a string at byte {offset} runs past the end of the file")
        return self._map[offset + 8:end].decode("utf-8", errors="replace"), end

    def _value(self, kind: int, offset: int) -> tuple[Any, int]:
        if kind == _STRING:
            return self._string(offset)
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return self._unpack(fmt, offset)[0], offset + struct.calcsize(fmt)
        if kind != _ARRAY:
            raise GgufFormatError(f"unknown value type {kind} at byte {offset}")
        item, count = self._unpack("<IQ", offset)
        offset += 12
        lazy = LazyArray(item, count, offset)
        end = self._skip(lazy)
        if item == _STRING or count > self._eager:
            return lazy, end
        return self._decode(lazy), end

    def _skip(self, lazy: LazyArray) -> int:
        """The offset after the array's items (strings walked by their lengths, nothing decoded)."""
        if lazy.item_type in _DTYPES:
            return lazy.offset + lazy.count * np.dtype(_DTYPES[lazy.item_type]).itemsize
        if lazy.item_type != _STRING:  # (arrays of arrays: no converter writes them)
            raise GgufFormatError(f"arrays of value type {lazy.item_type} are not supported")
        offset, unpack = lazy.offset, struct.Struct("<Q").unpack_from
        try:
            for _ in range(lazy.count):
                offset += 8 + unpack(self._map, offset)[0]
        except struct.error:
            raise GgufFormatError(f"a string array at byte {lazy.offset} runs past the end of the file") from None
        return offset

    def _decode(self, lazy: LazyArray) -> list:
        if lazy.item_type in _DTYPES:
            return np.frombuffer(self._map, dtype=_DTYPES[lazy.item_type], count=lazy.count,
                                 offset=lazy.offset).tolist()
        out, offset, unpack, data = [], lazy.offset, struct.Struct("<Q").unpack_from, self._map
        for _ in range(lazy.count):
            n = unpack(data, offset)[0]
            out.append(data[offset + 8:offset + 8 + n].decode("utf-8", errors="replace"))
            offset += 8 + n
        return out

    def value(self, key: str, default: Any = None) -> Any:
        """The value of `key`, decoding a lazy array (counted in decoded_arrays)."""
        value = self.metadata.get(key, default)
        if isinstance(value, LazyArray):
            self.decoded_arrays += 1
            return self._decode(value)
        return value

    def tensor_bytes(self, info: TensorInfo, nbytes: int) -> np.ndarray:
        """The `nbytes` bytes of tensor `info` as a read-only uint8 view of the mapping."""
        if info.offset + nbytes > len(self._map):
            raise GgufFormatError(f"tensor {info.name!r} runs past the end of the file")
        return self.data[info.offset:info.offset + nbytes]
