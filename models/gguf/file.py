"""A GGUF file (llama.cpp's format) as Tandem reads it: metadata as plain Python values and tensors by name,
dequantized one at a time to float32 numpy arrays in their stored (row-major, HF [out, in]) layout.

Reading and dequantizing are the `gguf` package's (GGUFReader memory-maps the file; nothing is copied until a
tensor is dequantized). Torch-free: the GGUF -> HF converter (scripts/prepare_default_model.py) uses it too.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from tandem.errors import CheckpointError

# Vocabulary arrays (tens of thousands of entries): read only when asked for (tokenizer_field).
_LARGE_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                 "tokenizer.ggml.scores")


class GgufFile:
    """An open GGUF file: `metadata` (every key but the tokenizer's arrays), `tensor_shapes` (numpy order:
    [rows, columns] for a matrix), `tensor_types` (GGML type names) and `tensor(name)` -> float32 array."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        try:
            self._reader = GGUFReader(self.path)
        except (OSError, ValueError, struct.error, IndexError, KeyError) as exc:
            raise CheckpointError(f"{self.path}: cannot read it as a GGUF file: {exc}") from exc
        self.fields = self._reader.fields  # gguf's ReaderFields by key
        self.metadata: dict[str, Any] = {k: _value(f) for k, f in self.fields.items()
                                         if k not in _LARGE_ARRAYS}
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.tensor_shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in self._tensors.items()}
        self.tensor_types = {n: t.tensor_type.name for n, t in self._tensors.items()}

    def tokenizer_field(self, key: str, default: Any = None) -> Any:
        """A tokenizer.ggml.* value (token lists, merges, ids), read on demand."""
        field = self.fields.get(key)
        return default if field is None else _value(field)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, shaped as stored ([rows, columns] for a matrix)."""
        from gguf import quants

        t = self._tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        try:
            data = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(f"{self.path}: tensor {name!r} is stored as {t.tensor_type.name}, which the "
                                  f"gguf package cannot dequantize ({exc})") from None
        out = np.ascontiguousarray(data.reshape(self.tensor_shapes[name]), dtype=np.float32)
        # float32 tensors come back as views of the read-only memory map: the model gets its own copy
        return out if out.flags.writeable else out.copy()


def _value(field: Any) -> Any:
    """A field as a Python value: str, int, float, bool, or a list of them."""
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value
