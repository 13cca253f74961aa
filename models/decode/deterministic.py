"""The forward of `--deterministic`: every row of every call — a prompt chunk's tokens, a decode step's token,
an item's drafts — through the native step (models/native/decode_step.cpp), one row per token.

Why the native step: its arithmetic for a row depends only on that row and the K/V of its own sequence. Each
output of a linear layer is one accumulator summed in k order by one thread (gemm.h: the same bits whatever
the number of rows, which rows, or how the team splits the outputs); RMSNorm, rotary and the K/V write are
per row; attention runs per (row, KV head) over positions 0..pos in token order, whatever else the call
holds; every row's K/V are written before any row attends, so rows of one sequence at consecutive positions
(a prompt chunk, an item's drafts) each see the rows before them as one token per call would. So a position's
K/V and logits are the same bits whether it was computed in a prompt chunk of any size, in any batch, as a
decode step or a draft, on any number of threads — which is what identity across chunking, preemption
(recompute), restarts and failover (another executor recomputes) needs. The eager PyTorch forward cannot
promise it: its matrix kernels choose blocking, and so summation order, by the number of rows.

The one input the step takes from torch is the rotary cos/sin of each position. Torch's elementwise cos/sin
of a [B, d] tensor vectorise the flattened tensor and finish its tail with scalar code, which may round
differently, and where the tail falls depends on B and the thread count; here they come from a table filled
ROPE_BLOCK positions at a time, each block one call of the model's own rotary on one thread, so a position's
values never depend on the call it is in.

The cost against the eager prefill: the native step is a decode kernel (register tiles of 4 weight rows x
3 activation rows, no cache blocking for long chunks) and computes the LM head for every row; a call's rows go
in slices of MAX_ROWS so that the logits of a long chunk never exist at once.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from models.kv.paged_cache import PagedKvCache
from models.decode.native import NativeBuild, NativeDecode
from models.sampler import one_thread
from models.transformer import DecoderModel

ROPE_BLOCK = 256  # positions per cos/sin table block (a multiple of every vector width's unrolled step)
MAX_ROWS = 128  # rows per native call: bounds the [rows, vocab] logits (and the step's scratch) of one slice


class RopeTable:
    """cos/sin [head_dim] float32 per position, filled ROPE_BLOCK positions at a time (see the module
    docstring: the same bits for a position whatever call asks for it)."""

    def __init__(self, model: DecoderModel) -> None:
        self.rotary = model.rotary
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _block(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._blocks.get(index)
        if got is None:
            positions = torch.arange(index * ROPE_BLOCK, (index + 1) * ROPE_BLOCK, dtype=torch.int64)
            with one_thread():
                cos, sin = self.rotary.cos_sin(positions, torch.float32)  # [ROPE_BLOCK, head_dim] each
            got = self._blocks[index] = (cos.contiguous(), sin.contiguous())
        return got

    def cos_sin(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B] int64 -> cos, sin [B, head_dim] float32, copied out of the table (exact copies)."""
        blocks = positions // ROPE_BLOCK
        cos = sin = None
        for index in np.unique(blocks).tolist():
            c, s = self._block(index)
            if cos is None:
                cos, sin = c.new_empty(len(positions), c.shape[1]), s.new_empty(len(positions), s.shape[1])
            rows = np.nonzero(blocks == index)[0]
            at = torch.from_numpy(positions[rows] % ROPE_BLOCK)
            cos[torch.from_numpy(rows)] = c[at]
            sin[torch.from_numpy(rows)] = s[at]
        return cos, sin


class RowInvariantStep(NativeDecode):
    """The native step with cos/sin from the rope table, and `rows` for calls of any number of rows per sequence."""

    def __init__(self, model: DecoderModel, kv: PagedKvCache, build: NativeBuild | None = None,
                 huge_pages: str = "auto") -> None:
        super().__init__(model, kv, build, huge_pages)  # ValueError / RuntimeError: see NativeDecode
        self.rope = RopeTable(model)

    def _cos_sin(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """NativeDecode.run's cos/sin, from the rope table (the same bits for a position whatever the call)."""
        return self.rope.cos_sin(positions)

    def rows(self, token_ids: Sequence[int], tables: Sequence[Sequence[int]], pasts: Sequence[int],
             keep: Sequence[int]) -> torch.Tensor:
        """Every row run (K/V written at its position), in slices of MAX_ROWS in order (a sequence's rows come
        in position order, so each slice sees the K/V of the slices before it); returns the logits of the rows
        `keep` (indices, ascending), [len(keep), vocab] float32."""
        out, k = [], 0
        for start in range(0, len(token_ids), MAX_ROWS):
            end = min(start + MAX_ROWS, len(token_ids))
            picked = []
            while k < len(keep) and keep[k] < end:
                picked.append(keep[k] - start)
                k += 1
            logits = self.run(token_ids[start:end], tables[start:end], pasts[start:end],
                              None if len(picked) == end - start else picked)  # [len(picked), vocab]
            if picked:
                out.append(logits)
        if not out:
            return torch.empty(0, self.model.config.vocab_size, dtype=torch.float32)
        return out[0] if len(out) == 1 else torch.cat(out)
