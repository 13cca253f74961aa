"""A GGUF file (llama.cpp's format) as Tandem reads it: metadata as plain Python values and tensors by name,
either as stored (`raw`: the bytes of a block-quantized matrix, [rows, row_bytes]) or dequantized to float32
numpy arrays in their stored (row-major, HF [out, in]) layout.

The header is read by tandem/gguf_reader.py, which leaves the tokenizer's arrays (tens of thousands of
strings) undecoded until asked for (`tokenizer_field`); the file is memory-mapped, so nothing is read until
a tensor is. Dequantizing is the `gguf` package's. Torch-free: the GGUF -> HF converter
(scripts/prepare_default_model.py) uses it too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tandem.gguf_reader import GgufFormatError, GgufHeader, LazyArray
from tandem.errors import CheckpointError


class GgufFile:
    """An open GGUF file: `metadata` (every key but the tokenizer's arrays), `tensor_shapes` (numpy order:
    [rows, columns] for a matrix), `tensor_types` (GGML type names), `raw(name)` -> the stored array and
    `tensor(name)` -> float32 array."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGMLQuantizationType

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        try:
            self.header = GgufHeader(self.path)
        except (OSError, GgufFormatError) as exc:
            raise CheckpointError(f"{self.path}: cannot read it as a GGUF file: {exc}") from exc
        header = self.header
        self.metadata: dict[str, Any] = {
            k: header.value(k) for k, v in header.metadata.items()
            if not (k.startswith("tokenizer.") and isinstance(v, LazyArray))}
        self._tensors = header.tensors
        self.tensor_shapes = {n: t.shape for n, t in self._tensors.items()}
        try:
            self.tensor_types = {n: GGMLQuantizationType(t.ggml_type).name for n, t in self._tensors.items()}
        except ValueError as exc:
            raise CheckpointError(f"{self.path}: unknown GGML tensor type: {exc}") from None

    def tokenizer_field(self, key: str, default: Any = None) -> Any:
        """A tokenizer.ggml.* value (token lists, merges, ids), read on demand."""
        return self.header.value(key, default)

    def tokenizer_metadata(self) -> dict[str, Any]:
        """Every tokenizer.* key and its value, the arrays decoded (scheduler/text/gguf_tokenizer.py)."""
        return {k: self.header.value(k) for k in self.header.metadata if k.startswith("tokenizer.")}

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored, a read-only view of the mapped file: F32 and F16 as their numpy dtype in the
        tensor's shape; the other types as uint8 [rows, row_bytes] (a block type's rows are whole blocks)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        info = self._tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        qtype = GGMLQuantizationType(info.ggml_type)
        block, size = GGML_QUANT_SIZES[qtype]
        *outer, columns = info.shape or (1,)
        if columns % block:
            raise CheckpointError(f"{self.path}: tensor {name!r} has rows of {columns}, not whole {qtype.name} "
                                  f"blocks of {block}")
        rows = int(np.prod(outer)) if outer else 1
        row_bytes = columns // block * size
        try:
            data = self.header.tensor_bytes(info, rows * row_bytes)
        except GgufFormatError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from None
        if qtype.name in ("F32", "F16"):  # (BF16, which numpy lacks, is bytes as for the block types)
            return data.view(np.float32 if qtype.name == "F32" else np.float16).reshape(info.shape)
        return data.reshape(*outer, row_bytes) if outer else data

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, shaped as stored ([rows, columns] for a matrix)."""
        from gguf import GGMLQuantizationType, quants

        data = self.raw(name)
        qtype = GGMLQuantizationType(self._tensors[name].ggml_type)
        try:
            values = data if qtype.name == "F32" else quants.dequantize(data, qtype)
        except NotImplementedError as exc:
            raise CheckpointError(f"{self.path}: tensor {name!r} is stored as {qtype.name}, which the "
                                  f"gguf package cannot dequantize ({exc})") from None
        out = np.ascontiguousarray(values.reshape(self.tensor_shapes[name]), dtype=np.float32)
        # float32 tensors come back as views of the read-only memory map: the model gets its own copy
        return out if out.flags.writeable else out.copy()
