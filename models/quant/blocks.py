"""Weights kept in llama.cpp's block formats (models/quant/block_formats.py), as a GGUF file stores them: one
resident copy of the blocks, never a float copy beside them.

- `BlockWeight`: a linear layer's weight as consecutive row ranges (parts), each in one format (a fused q/k/v
  of a Q4_K_M file is Q4_K q/k rows then Q6_K v rows). Repacked parts (`repack_block_weights`: Q4_0, Q8_0,
  Q4_K, Q6_K rows interleaved 8 by 8) at every size, and small calls (decode) of the others, run the native kernel
  on the blocks (`torch.ops.tandem.block_linear`: activations quantized to 8 bits per block of 32, or of 256 for
  the K-quants, integer dot products, as llama.cpp does); larger calls of the other formats (prefill) dequantize
  each part once per call
  and multiply in float, which the call's many rows amortize, with the activations rounded to the same 8 bits first
  (`q8_activations`): both paths then compute the same products up to float rounding, so that a prompt
  recomputed after preemption, or drafts verified in one call, give what decode steps gave (without it they
  differed by ~0.5% per product, and greedy continuations diverged).
- `QuantEmbedding`: an embedding table in blocks; a lookup dequantizes only the rows asked for. A tied LM
  head multiplies with the same BlockWeight (`.blocks`), so one copy serves both.

The native ops come with the library models/native/library.py builds; `block_ops_available` loads it once
(at model load) and says whether they are there. Without them (no compiler, a CPU without AVX2, a library
without the block kernels) everything runs on the `gguf` package's numpy dequantizer and F.linear: the same
weights, slower.
"""
from __future__ import annotations

import logging
import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.memory.huge_pages import arena_bytes, copy_to_huge_pages
from models.memory.mapped_pages import file_mappings, in_mappings, release_file_pages
from models.native.library import NativeBuild, load_kernel, machine_refusal
from models.quant.block_formats import BlockFormat, dequantize_reference

log = logging.getLogger("tandem.models")

# Rows per call up to which block_linear runs on the blocks. It reads every block once per call and quantizes
# the activations per row, so its cost grows with the rows; dequantizing the weight costs the same once per
# call whatever the rows and is then amortized by a float GEMM. Decode steps (a few rows) are bound by reading
# the weights, which the blocks make 4-8x smaller than float32; a prefill chunk is bound by arithmetic.
# Measured on 2 AVX2 cores, a [8192, 2048] Q4_K weight: 16 rows 6.7 ms on the blocks against 13 ms for the
# float GEMM alone (plus ~20 ms to dequantize); at 512 rows the two GEMMs are within 15%, and the float one
# is the one with cache blocking.
# Repacked rows (Q4_0, Q8_0, Q4_K, Q6_K; models/native/blocks_x8.h) run on the blocks at every size: their kernel
# unpacks each weight register once for 4 activation rows, 1.1-1.6x the float GEMM's speed at 512 rows on 2 AVX2
# cores (measured [2048, 2048], one thread: Q4_0 / Q4_K 117 against 73-81 GFLOP/s, Q6_K 91 against 80; Q8_0, CPU
# time, 92-97 against 61-66 with its dequantizing), and nothing to dequantize.
SMALL_ROWS = 32
# Weights of more elements than this are never dequantized whatever the rows (the LM head of a large
# vocabulary: 151936 x 2048 would be a 1.2 GB float copy per call).
NEVER_DEQUANTIZED = 1 << 25

_available: bool | None = None  # whether the native block ops are loaded (None: not asked yet)
_lock = threading.Lock()
_scratch = threading.local()  # .buf: this thread's float32 buffer for dequantized weights (prefill)


def _scratch_for(rows: int, columns: int) -> torch.Tensor:
    """A float32 [rows, columns] view of this thread's reused buffer (grown as needed): a fresh tensor per
    call costs a page fault per 4 KiB of it, ~16k for a [8192, 2048] weight. Valid until the thread's next call."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < rows * columns:
        buf = _scratch.buf = torch.empty(rows * columns)
    return buf[:rows * columns].view(rows, columns)


def _ops_present() -> bool:
    return hasattr(torch.ops.tandem, "block_linear") and hasattr(torch.ops.tandem, "block_dequant")


def block_ops_available(build: NativeBuild | None = None) -> bool:
    """Whether the native block kernels run in this process: loads the native library once (building it on
    the first start, ~30 s) and remembers the answer; where it cannot be built or loaded, or lacks the block
    ops, logs one warning with the reason (the numpy fallback then runs)."""
    global _available
    with _lock:
        if _available is None:
            reason = machine_refusal(build)
            if reason is None:
                try:
                    load_kernel(build)
                except (RuntimeError, OSError) as exc:
                    reason = f"the native library could not be built or loaded: {exc}"
            _available = _ops_present()
            if not _available:
                log.warning("block weights run on the numpy dequantizer and F.linear (slow): %s",
                            reason or "the native library has no block kernels")
        return _available


def _native() -> bool:
    """Whether the ops run now (not asked yet: whether something loaded them; no build here)."""
    return _available if _available is not None else _ops_present()


def q8_activations(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x float32 [T, in] (in % group == 0) with each block of `group` values rounded as block_linear quantizes
    them for a format whose blocks hold `group` weights (32, or 256 for the K-quants: `fmt.block_weights`):
    q = round-half-even(x * 127 / absmax), value q * absmax / 127 (models/native/blocks.h quantize_q8 /
    quantize_q8_256)."""
    b = x.view(x.shape[0], -1, group)  # [T, in / group, group]
    amax = b.abs().amax(dim=-1, keepdim=True)  # [T, in / group, 1]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(b * inv) * (amax / 127.0)).view_as(x)


def dequantize(fmt: BlockFormat, blocks: torch.Tensor, columns: int) -> torch.Tensor:
    """blocks uint8 [rows, row_bytes] (CPU) -> float32 [rows, columns]."""
    if _native():
        return torch.ops.tandem.block_dequant(blocks.contiguous(), fmt.kind, columns)
    return torch.from_numpy(dequantize_reference(blocks.numpy(), fmt, columns))


class BlockWeight:
    """A linear layer's weight [out_features, in_features] in blocks: `parts` are consecutive row ranges, each
    (format, uint8 [rows_i, fmt.row_bytes(in_features)]); `bias` float32 [out_features] or None. Called on
    x [T, in_features] (any float dtype) -> [T, out_features] in x's dtype."""

    def __init__(self, parts: list[tuple[BlockFormat, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None) -> None:
        if not parts:
            raise ValueError("a BlockWeight needs at least one part")
        for fmt, blocks in parts:
            if in_features % fmt.block_weights:
                raise ValueError(f"{fmt.name} rows hold whole blocks of {fmt.block_weights} weights; "
                                 f"in_features {in_features} is not a multiple")
            if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != fmt.row_bytes(in_features):
                raise ValueError(f"{fmt.name} blocks of {in_features} columns are uint8 [rows, "
                                 f"{fmt.row_bytes(in_features)}], got {blocks.dtype} {tuple(blocks.shape)}")
        self.parts = [(fmt, blocks.contiguous()) for fmt, blocks in parts]
        self.in_features = in_features
        self.out_features = sum(int(b.shape[0]) for _, b in self.parts)
        self.bias = None if bias is None else bias.detach().float()
        self.formats = tuple(dict.fromkeys(fmt.name for fmt, _ in self.parts))

    @property
    def kernel(self) -> str:
        """What runs the calls, for logs: "blocks" (native kernels) or "blocks-numpy" (the fallback)."""
        return "blocks" if _native() else "blocks-numpy"

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for _, b in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        x32 = x.float().contiguous()
        if _native():
            big = self.out_features * self.in_features > NEVER_DEQUANTIZED
            outs, rounded = [], {}  # (x rounded per group of 32 / 256, made once each)
            for fmt, b in self.parts:
                if x.shape[0] <= SMALL_ROWS or big or fmt.interleave != 1:  # on the blocks
                    outs.append(torch.ops.tandem.block_linear(x32, b, fmt.kind, self.in_features, None))
                else:  # dequantized into the thread's scratch, activations rounded as the kernel rounds them
                    if fmt.block_weights not in rounded:
                        rounded[fmt.block_weights] = q8_activations(x32, fmt.block_weights)
                    xq = rounded[fmt.block_weights]
                    outs.append(F.linear(xq, torch.ops.tandem.block_dequant(
                        b, fmt.kind, self.in_features, _scratch_for(b.shape[0], self.in_features))))
        else:  # (the numpy fallback has no kernel to agree with: float activations there)
            outs = [F.linear(x32, dequantize(fmt, b, self.in_features)) for fmt, b in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [T, out]
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 [out_features, in_features] (a fresh tensor)."""
        mats = [dequantize(fmt, b, self.in_features) for fmt, b in self.parts]
        return mats[0] if len(mats) == 1 else torch.cat(mats)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight dequantized: float32 [T, in_features] (single-part weights only: an
        embedding table)."""
        if len(self.parts) != 1:
            raise ValueError("row lookups read single-part block weights (an embedding table)")
        fmt, blocks = self.parts[0]
        if fmt.interleave != 1:  # (repacked rows are not separable as bytes)
            return torch.ops.tandem.block_rows(blocks, fmt.kind, self.in_features, ids.to(torch.long).contiguous())
        return dequantize(fmt, blocks.index_select(0, ids), self.in_features)

    def select_rows(self, rows: torch.Tensor, bias: torch.Tensor | None) -> BlockWeight:
        """Rows `rows` [R] (ascending indices into out_features) as a new BlockWeight (copies of the rows, part
        by part) with `bias` [R]: a column-parallel shard (models/parallel/shard.py)."""
        self._refuse_repacked("rows")
        parts, start = [], 0
        for fmt, blocks in self.parts:
            n = blocks.shape[0]
            local = rows[(rows >= start) & (rows < start + n)] - start
            if local.numel():
                parts.append((fmt, blocks.index_select(0, local)))
            start += n
        return BlockWeight(parts, self.in_features, bias)

    def select_columns(self, first: int, end: int, bias: torch.Tensor | None) -> BlockWeight:
        """Columns [first, end) as a new BlockWeight with `bias`: a row-parallel shard. ValueError unless both
        ends are on block boundaries of every part's format (a block is split by no one)."""
        self._refuse_repacked("columns")
        for fmt, _ in self.parts:
            if first % fmt.block_weights or end % fmt.block_weights:
                raise ValueError(f"columns [{first}, {end}) cut {fmt.name} blocks of {fmt.block_weights} weights")
        parts = [(fmt, blocks[:, fmt.row_bytes(first):fmt.row_bytes(end)].contiguous()) for fmt, blocks in self.parts]
        return BlockWeight(parts, end - first, bias)

    def _refuse_repacked(self, what: str) -> None:
        if any(fmt.interleave != 1 for fmt, _ in self.parts):  # (shards are cut at load, before repacking)
            raise ValueError(f"{what} of block weights repacked 8 by 8 cannot be selected as bytes")

    def widest_block(self) -> int:
        """The widest block of its formats: a column split must fall on a multiple of it."""
        return max(fmt.block_weights for fmt, _ in self.parts)


def stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Parameter:
    """A Parameter of `shape`, `dtype` and `device` holding one element (expanded): for code that reads a
    module's weight.dtype / .device / .shape where the weight itself is in blocks."""
    return nn.Parameter(torch.zeros(1, dtype=dtype, device=device).expand(shape), requires_grad=False)


class QuantEmbedding(nn.Module):
    """An embedding table [vocab, hidden] in blocks (one part); forward(ids [T]) -> [T, hidden] in the
    model's dtype (`weight.dtype`), dequantizing only the rows asked for. `weight` is a stand-in of the
    table's shape and dtype; `blocks` the table, which a tied LM head shares (`lm_head.quant = blocks`)."""

    def __init__(self, blocks: BlockWeight, dtype: torch.dtype) -> None:
        super().__init__()
        if len(blocks.parts) != 1:
            raise ValueError("an embedding table in blocks is one part")
        self.blocks = blocks
        self.num_embeddings, self.embedding_dim = blocks.out_features, blocks.in_features
        self.weight = stand_in((self.num_embeddings, self.embedding_dim), dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, hidden]
        return self.blocks.rows(ids.reshape(-1)).to(self.weight.dtype).view(*ids.shape, self.embedding_dim)


def block_weights(model: nn.Module) -> list[BlockWeight]:
    """Every BlockWeight of `model` (its linear layers' `quant` and block embeddings' tables), each once."""
    found: dict[int, BlockWeight] = {}
    for m in model.modules():  # (a table's `blocks`: QuantEmbedding and its vocabulary-parallel shard)
        for w in (getattr(m, "blocks", None), getattr(m, "quant", None)):
            if isinstance(w, BlockWeight):
                found.setdefault(id(w), w)
    return list(found.values())


def from_mapped(blocks: np.ndarray) -> torch.Tensor:
    """A uint8 [rows, row_bytes] numpy array (a view of a read-only file mapping, or an array) as a tensor
    sharing its memory (torch warns on read-only arrays; nothing writes to blocks)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(blocks)


def weight_format(model: nn.Module) -> str:
    """What the model's weights are, for the KV fingerprint and GetInfo: "float", or "gguf-blocks:" and the
    block formats ("gguf-blocks:Q4_K+Q6_K"): K and V computed from other weights are other numbers."""
    formats = sorted({f for w in block_weights(model) for f in w.formats})
    return f"gguf-blocks:{'+'.join(formats)}" if formats else "float"


def weights_summary(model: nn.Module) -> str:
    """The weights' bytes by kind, for the startup log: "92.0 MiB: blocks Q4_1 (150 matrices, 63.3 MiB), Q8_0
    (1 matrix, 28.7 MiB); float float32 0.1 MiB" (a matrix: one part of a BlockWeight, a fused q/k/v's
    same-format rows joined; float: the norms, biases and matrices the file stores as float)."""
    by_format: dict[str, list[int]] = {}
    for w in block_weights(model):
        for fmt, blocks in w.parts:
            entry = by_format.setdefault(fmt.name, [0, 0])
            entry[0] += 1
            entry[1] += blocks.numel()
    floats: dict[str, int] = {}
    for p in {id(p): p for p in model.parameters()}.values():
        nbytes = p.numel() * p.element_size()
        if p.untyped_storage().nbytes() >= nbytes:  # (not a stand-in of a weight held elsewhere)
            name = str(p.dtype).removeprefix("torch.")
            floats[name] = floats.get(name, 0) + nbytes
    mib = lambda n: f"{n / (1 << 20):.1f} MiB"  # noqa: E731
    total = sum(b for _, b in by_format.values()) + sum(floats.values())
    blocks = ", ".join(f"{name} ({n} {'matrix' if n == 1 else 'matrices'}, {mib(b)})"
                       for name, (n, b) in sorted(by_format.items()))
    plain = ", ".join(f"{name} {mib(b)}" for name, b in sorted(floats.items()))
    return f"{mib(total)}: " + "; ".join(filter(None, [blocks and f"blocks {blocks}", plain and f"float {plain}"]))


def repack_block_weights(model: nn.Module) -> int:
    """Repacks the rows of every block part whose format has a layout for the native kernels (Q4_0, Q8_0, Q4_K,
    Q6_K: 8 rows interleaved, models/native/blocks_x8.h) where those kernels run. Still one resident copy: a part in
    writable memory (the huge-page arena, a copy) is rewritten in place, one that is a view of the mapped file
    is replaced by its repacked copy and the file's pages are released. Returns the bytes repacked."""
    if not _native():
        return 0
    spans = file_mappings()
    done = 0
    for w in block_weights(model):
        parts = []
        for fmt, blocks in w.parts:
            to = fmt.repacked()
            if to is None or blocks.numel() == 0:
                parts.append((fmt, blocks))
                continue
            packed = torch.ops.tandem.block_repack(blocks, fmt.kind, w.in_features)
            if in_mappings(blocks, spans):
                release_file_pages([blocks])
            else:
                blocks.copy_(packed)
                packed = blocks
            parts.append((to, packed))
            done += blocks.numel()
        w.parts = parts
    return done


def move_blocks_to_huge_pages(model: nn.Module, mode: str) -> int:
    """Copies every block tensor of `model` into one huge-page arena (models/memory/huge_pages.py; mode as
    --huge-pages) and releases the file pages they were views of: still one resident copy. Returns the bytes
    moved."""
    weights = block_weights(model)
    tensors = [b for w in weights for _, b in w.parts]
    copies = iter(copy_to_huge_pages(tensors, mode))
    moved = 0
    for w in weights:
        parts = []
        for fmt, blocks in w.parts:
            copy = next(copies)
            if copy.data_ptr() != blocks.data_ptr():
                release_file_pages([blocks])
                moved += arena_bytes([copy])
            parts.append((fmt, copy))
        w.parts = parts
    return moved

