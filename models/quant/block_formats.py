"""llama.cpp's block formats that Tandem keeps quantized in memory and computes on: their sizes, the kernel
kind each is to the native library (models/native/blocks.h), and the reference dequantizer (the `gguf`
package's numpy code: the test oracle and the fallback where the native library cannot be built).

A weight in one of these formats is a uint8 tensor [rows, row_bytes]: each row is columns / block_weights
blocks of block_bytes, laid out as in the GGUF file (ggml's block_q4_0, block_q4_K, ...), so rows can be
permuted, split and concatenated as bytes. Norms, biases and LoRA adapters stay float.

Q4_0, Q8_0, Q4_K and Q6_K also have a repacked layout (`repacked()`; models/native/blocks_x8.h): the same bytes per
row, the blocks of each 8 rows interleaved for the native kernels, made at load where those run
(models/quant/blocks.py `repack_block_weights`). Such rows are no longer separable as bytes; the format's name
stays its ggml name (the numbers are the same weights).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockFormat:
    name: str           # ggml's type name ("Q4_K")
    ggml_type: int      # ggml's type id (GGMLQuantizationType)
    block_weights: int  # weights per block (32, or 256 for the K-quants)
    block_bytes: int    # bytes per block
    interleave: int = 1  # 8: rows repacked 8 by 8 (models/native/blocks_x8.h); 1: as in the file

    @property
    def kind(self) -> int:
        """The TdLinear kind of this format in the native library (100 + ggml's type id; repacked: 200 + it)."""
        return (200 if self.interleave == 8 else 100) + self.ggml_type

    def repacked(self) -> "BlockFormat | None":
        """This format with its rows repacked 8 by 8, where the native kernels have that layout; else None."""
        return dataclasses.replace(self, interleave=8) if self.interleave == 1 and self.name in REPACKABLE else None

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


REPACKABLE = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")  # the formats with a repacked layout (models/native/blocks_x8.h)


def dequantize_reference(blocks: np.ndarray, fmt: BlockFormat, columns: int) -> np.ndarray:
    """blocks uint8 [rows, row_bytes] -> float32 [rows, columns], by the gguf package's numpy code (plain layout
    only: repacked rows are the native library's)."""
    if fmt.interleave != 1:
        raise ValueError(f"{fmt.name} rows repacked 8 by 8 have no numpy reference; dequantize them natively")
    from gguf import GGMLQuantizationType, quants

    rows = blocks.reshape(-1, fmt.row_bytes(columns))
    out = quants.dequantize(np.ascontiguousarray(rows), GGMLQuantizationType(fmt.ggml_type))
    return np.asarray(out, dtype=np.float32).reshape(rows.shape[0], columns)
