"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start (before READY), replayed for
all-decode batches padded up to the nearest bucket.

A decode step of a small model on a GPU is launch-bound (hundreds of kernels of microseconds each); a replayed
graph launches them as one. A graph's shapes are fixed, so:
- batch sizes round up to a bucket (`graph_buckets`: 1, 2, 4, 8, then every 8 up to the largest); a padded row
  repeats row 0 (the same K/V written to the same slot again, its logits dropped), as models/decode/compiled.py
  pads;
- the block table is as wide as the longest sequence can need (max positions / block size), padded with block
  0 and masked by the context lengths;
- the inputs live in static buffers the step copies into before each replay.
Batches over the largest bucket (or of a bucket the budget left uncaptured) run the same decode forward eagerly
(`run` does it: `eager_calls` counts them); everything that is not an all-decode batch runs the eager forward
of executor_service/step/batch.py. executor_service/step/decode_choice.py decides whether the executor uses this.

Capture stops at the start-up budget (`capture_budget_s`, default 60 s): buckets not captured by then run
eager, and the log says which. Only with `torch.cuda.is_available()`; the bucket and padding logic below is
pure and tested on CPU (tests/models/test_cuda_graphs.py), the capture itself by the CUDA-marked test there
(scripts/gpu_check runs it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from models.attention.decode import DecodeMetadata
from models.kv.paged_cache import PagedKvCache, decode_block_table
from models.transformer import DecoderModel
from tandem.ceil_div import ceil_div

log = logging.getLogger("tandem.cuda_graphs")

DEFAULT_CAPTURE_BUDGET_S = 60.0


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then multiples of 8 up to max_batch (which is
    always the last; a max_batch below 1 gives none)."""
    if max_batch < 1:
        return ()
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return tuple(sizes) + (max_batch,)


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `rows` rows; None when none does (the step runs eager)."""
    return next((b for b in buckets if b >= rows), None)


@dataclass(frozen=True)
class PaddedDecode:
    """One decode step's inputs padded to a bucket (numpy int64): ids, positions, slots, lens [bucket];
    table [bucket, width]."""

    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    table: np.ndarray
    lens: np.ndarray
    rows: int  # the real rows (the first `rows` of each array)


def pad_decode(token_ids: Sequence[int], tables: Sequence[Sequence[int]], pasts: Sequence[int], bucket: int,
               block_size: int, width: int) -> PaddedDecode:
    """Item i feeds token_ids[i] at position pasts[i] of the cache whose blocks are tables[i]. Rows past the
    items repeat row 0; the table is exactly `width` columns (ValueError if a sequence needs more)."""
    rows = len(token_ids)
    if not 0 < rows <= bucket:
        raise ValueError(f"{rows} rows do not fit a bucket of {bucket}")
    need = max(ceil_div(p + 1, block_size) for p in pasts)
    if need > width:
        raise ValueError(f"a sequence needs {need} blocks, the graphs' table holds {width}")
    table = decode_block_table(tables, pasts, block_size, bucket, width)
    ids = np.zeros(bucket, dtype=np.int64)
    positions = np.zeros(bucket, dtype=np.int64)
    slots = np.zeros(bucket, dtype=np.int64)
    for i, (tok, blocks, past) in enumerate(zip(token_ids, tables, pasts)):
        ids[i], positions[i] = tok, past
        slots[i] = blocks[past // block_size] * block_size + past % block_size
    table[rows:], ids[rows:], positions[rows:], slots[rows:] = table[0], ids[0], positions[0], slots[0]
    return PaddedDecode(ids, positions, slots, table, positions + 1, rows)


class CudaGraphDecode:
    """The decode step of captured graphs (a DecodeStep: `run` as models/decode/compiled.py's)."""

    def __init__(self, model: DecoderModel, kv: PagedKvCache, max_batch: int,
                 capture_budget_s: float = DEFAULT_CAPTURE_BUDGET_S) -> None:
        if not torch.cuda.is_available() or kv.k.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and KV pool on a CUDA device")
        self.model, self.kv = model, kv
        self.width = ceil_div(model.config.max_position_embeddings, kv.block_size)
        self.buckets = graph_buckets(max_batch)
        self.budget_s = capture_budget_s
        self.device = kv.k.device
        self._pools = (kv.k.unbind(0), kv.v.unbind(0))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}
        self.calls = 0  # steps replayed (read by tests and benchmarks)
        self.capture_s: float | None = None  # how long capture() took (benchmarks/device_figures.py reports it)
        self.eager_calls = 0  # steps with no captured bucket, run eagerly
        self.takes_drafts = False  # (a DecodeStep: drafted calls run the eager forward)

    @torch.inference_mode()
    def capture(self) -> float:
        """Captures the buckets, largest first (they share one memory pool), until the budget runs out.
        Writes only slot 0 of block 0, which no cache holds yet (call before serving). Returns the seconds taken."""
        start = time.monotonic()
        pool = None
        for bucket in sorted(self.buckets, reverse=True):
            if time.monotonic() - start > self.budget_s:
                log.warning("CUDA graph capture budget (%.0f s) spent: batches of %s rows run eager", self.budget_s,
                            sorted(b for b in self.buckets if b not in self._graphs))
                break
            static = {name: torch.zeros(bucket, dtype=torch.int64, device=self.device)
                      for name in ("ids", "positions", "slots", "lens")}
            static["lens"] += 1
            static["table"] = torch.zeros(bucket, self.width, dtype=torch.int64, device=self.device)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph (allocator, lazy init)
                    self._forward(static)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(static)
            pool = graph.pool()
            self._graphs[bucket] = (graph, static, out)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.monotonic() - start
        return self.capture_s

    def _forward(self, s: dict[str, torch.Tensor]) -> torch.Tensor:
        meta = DecodeMetadata(s["positions"], s["slots"], s["table"], s["lens"], *self._pools)
        return self.model(s["ids"], meta, self.kv, None)  # [bucket, vocab] float32

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets whose graphs were captured, ascending."""
        return tuple(sorted(self._graphs))

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], tables: Sequence[Sequence[int]], pasts: Sequence[int]) -> torch.Tensor:
        """One decode step through the bucket's graph -> float32 logits [B, vocab] (a copy: the graph's output
        buffer is overwritten by the next replay)."""
        bucket = bucket_for(len(token_ids), self.buckets)
        if bucket is None or bucket not in self._graphs:  # over the largest bucket, or not captured: eager
            bs = self.kv.block_size
            table = decode_block_table(tables, pasts, bs, len(token_ids))
            slots = [blocks[p // bs] * bs + p % bs for blocks, p in zip(tables, pasts)]
            t = lambda x: torch.as_tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
            self.eager_calls += 1
            return self._forward({"ids": t(token_ids), "positions": t(pasts), "slots": t(slots), "table": t(table),
                                  "lens": t([p + 1 for p in pasts])})
        graph, static, out = self._graphs[bucket]
        padded = pad_decode(token_ids, tables, pasts, bucket, self.kv.block_size, self.width)
        for name in ("ids", "positions", "slots", "table", "lens"):
            static[name].copy_(torch.from_numpy(getattr(padded, name)), non_blocking=False)
        graph.replay()
        self.calls += 1
        return out[:padded.rows].clone()
