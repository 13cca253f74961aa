"""llama.cpp's block formats that Tandem keeps quantized in memory and computes on: their sizes, the kernel
kind each is to the native library (models/native/blocks.h), and the reference dequantizer (the `gguf`
package's numpy code: the test oracle and the fallback where the native library cannot be built).

A weight in one of these formats is a uint8 tensor [rows, row_bytes]: each row is columns / block_weights
blocks of block_bytes, laid out as in the GGUF file (ggml's block_q4_0, block_q4_K, ...), so rows can be
permuted, split and concatenated as bytes. Norms, biases and LoRA adapters stay float.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockFormat:
    name: str           # ggml's type name ("Q4_K")
    ggml_type: int      # ggml's type id (GGMLQuantizationType)
    block_weights: int  # weights per block (32, or 256 for the K-quants)
    block_bytes: int    # bytes per block

    @property
    def kind(self) -> int:
        """The TdLinear kind of this format in the native library (100 + ggml's type id)."""
        return 100 + self.ggml_type

    def row_bytes(self, columns: int) -> int:
        """Bytes of one row of `columns` weights (columns % block_weights == 0)."""
        return columns // self.block_weights * self.block_bytes

    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_weights


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q4_0", 2, 32, 18), BlockFormat("Q4_1", 3, 32, 20), BlockFormat("Q5_0", 6, 32, 22),
    BlockFormat("Q5_1", 7, 32, 24), BlockFormat("Q8_0", 8, 32, 34), BlockFormat("Q4_K", 12, 256, 144),
    BlockFormat("Q5_K", 13, 256, 176), BlockFormat("Q6_K", 14, 256, 210),
)}


def dequantize_reference(blocks: np.ndarray, fmt: BlockFormat, columns: int) -> np.ndarray:
    """blocks uint8 [rows, row_bytes] -> float32 [rows, columns], by the gguf package's numpy code."""
    from gguf import GGMLQuantizationType, quants

    rows = blocks.reshape(-1, fmt.row_bytes(columns))
    out = quants.dequantize(np.ascontiguousarray(rows), GGMLQuantizationType(fmt.ggml_type))
    return np.asarray(out, dtype=np.float32).reshape(rows.shape[0], columns)
