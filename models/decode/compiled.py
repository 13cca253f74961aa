"""The compiled decode step: `torch.compile` of the model's forward for all-decode batches (every item adds
one token, no LoRA), one graph dynamic in the batch size and the block-table width, so no step ever waits
for a compile once the warm-up ran.

- Inputs are the tensors of `DecodeMetadata` (models/attention/decode.py); the KV write is an in-place
  custom op, attention a gather through the block table and one SDPA call per layer.
- CPU: inductor's C++ backend with freezing (the weights become constants the compiler packs for MKL/oneDNN
  itself; a copy of the linear weights, as the eager path's packed weights are). Rotary, RMSNorm, residual
  adds, SiLU x up and the attention mask are fused into a few loops per layer instead of ~150 small ops.
- CUDA: inductor's Triton backend (no CUDA-graph capture: the KV write is a mutation the graph trees refuse).
- Batches of one row are padded to two (a copy of the row: the same K/V written to the same slot, its logits
  dropped), and the table to at least two columns (block 0, masked): dynamo specialises sizes 0 and 1, and
  this keeps one graph for every batch.
- Everything else (prefill chunks, mixed batches, LoRA, drafts) stays on the eager forward; the sampler is
  eager in both.

`warm_up` compiles before the server reports READY. Inductor's on-disk cache (the compile cache directory)
keeps the compiled C++ kernels across restarts; torch does not cache AOT graphs compiled with freezing, so a
restart still traces and lowers the graph (SmolLM2 on 2 CPU cores: ~2 minutes either way, docs/performance.md).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from models.attention.decode import DecodeMetadata
from models.kv.paged_cache import PagedKvCache, decode_block_table
from models.moe import SparseMoeBlock
from models.transformer import DecoderModel

log = logging.getLogger("tandem.compile")

MIN_ROWS = 2  # see the module docstring
MIN_BLOCKS = 2


def set_compile_cache_dir(path: Path) -> None:
    """Where inductor keeps its on-disk caches (compiled kernels, FX graphs). Inductor reads the location from
    this environment variable whenever it looks for the cache; set before the first compile."""
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path.resolve())


def compile_refusal(model: DecoderModel) -> str | None:
    """Why this model cannot run the compiled step (None: it can)."""
    if any(getattr(m, "quant", None) is not None for m in model.modules()):
        return "--compile does not combine with --quantization yet (their kernels are eager-only); pick one"
    if model.config.mrope_section:
        return ("--compile traces one position per token; this model's M-RoPE (three per token, from its images) "
                "runs in the eager forward only")
    return None


class CompiledDecode:
    def __init__(self, model: DecoderModel, kv: PagedKvCache) -> None:
        reason = compile_refusal(model)
        if reason:
            raise ValueError(reason)
        self.model, self.kv = model, kv
        for m in model.modules():
            if isinstance(m, SparseMoeBlock):
                # Eager inside the compiled step: the routing is data-dependent, and torch._grouped_mm's
                # compile-time shape check wants bfloat16 where its CPU kernel takes float32. (Wrapped here, not
                # decorated in moe.py: torch.compiler.disable imports torch._dynamo, ~2.7 s of every start.)
                m.forward = torch.compiler.disable(m.forward)
        self.device = model.lm_head.weight.device
        # Only the batch size and the table width are dynamic (marked per call, see _call): with every
        # dimension dynamic, "duck sizing" ties equal sizes together (a batch of 2 = a model's 2 KV heads) and
        # the next batch recompiles.
        self._forward = torch.compile(model.forward, dynamic=False)
        self._pools_of: torch.Tensor | None = None
        self._pools: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] = ((), ())
        self.calls = 0  # decode steps that ran compiled (read by tests and benchmarks)
        self.takes_drafts = False  # (not verified for rows of one sequence: drafted calls run eager)

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], tables: Sequence[Sequence[int]], pasts: Sequence[int]) -> torch.Tensor:
        """One decode step: item i feeds token_ids[i] at position pasts[i] of the cache whose blocks are
        tables[i] (already reserved for it). Returns float32 logits [B, vocab]."""
        rows = len(token_ids)
        bs = self.kv.block_size
        padded = max(rows, MIN_ROWS)
        table = decode_block_table(tables, pasts, bs, padded, MIN_BLOCKS)
        ids = np.zeros(padded, dtype=np.int64)
        positions = np.zeros(padded, dtype=np.int64)
        slots = np.zeros(padded, dtype=np.int64)
        for i, (tok, blocks, past) in enumerate(zip(token_ids, tables, pasts)):
            ids[i], positions[i] = tok, past
            slots[i] = blocks[past // bs] * bs + past % bs
        table[rows:], ids[rows:], positions[rows:], slots[rows:] = table[0], ids[0], positions[0], slots[0]
        t = torch.from_numpy
        logits = self._call(t(ids), t(positions), t(slots), t(table), t(positions + 1))
        self.calls += 1
        return logits[:rows]

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
              lens: torch.Tensor) -> torch.Tensor:
        dev = self.device
        if self._pools_of is not self.kv.k:  # per-layer views of the pools, made once (models/attention/decode.py)
            self._pools = (self.kv.k.unbind(0), self.kv.v.unbind(0))
            self._pools_of = self.kv.k
        ids, positions, slots, table, lens = (x.to(dev) for x in (ids, positions, slots, table, lens))
        for x in (ids, positions, slots, table, lens):
            torch._dynamo.maybe_mark_dynamic(x, 0)
        torch._dynamo.maybe_mark_dynamic(table, 1)
        meta = DecodeMetadata(positions, slots, table, lens, *self._pools)
        # CPU: freezing (weights as constants, packed by the compiler); a patch of inductor's config for
        # this call only, read when a compile happens.
        with torch._inductor.config.patch(freezing=self.device.type == "cpu"):
            return self._forward(ids, meta, self.kv, None, None)  # [B, vocab]

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compiles the step (two shapes: the second reuses the first's graph, or a MoE model's eager segments
        recompile once as dynamic). Writes only slot 0 of block 0, which no cache holds yet (call it before
        serving). Returns the seconds it took."""
        start = time.monotonic()
        for rows, width in ((MIN_ROWS, MIN_BLOCKS + 1), (MIN_ROWS + 1, MIN_BLOCKS + 2)):
            zeros = torch.zeros(rows, dtype=torch.int64)
            self._call(zeros, zeros, zeros, torch.zeros(rows, width, dtype=torch.int64), zeros + 1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.monotonic() - start
