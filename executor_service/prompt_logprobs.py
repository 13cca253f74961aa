"""Prompt logprobs: for each token of a prompt chunk, its log-probability given the tokens before it, its rank
and the top-n alternatives there (UnifiedItem.prompt_logprobs), computed in the chunk's own forward.

Token i of a sequence is scored from the final hidden state of position i - 1: the chunk's own rows score its
tokens after the first, and the first token of a chunk at pos_offset > 0 is scored from the previous chunk's
last position, whose hidden state (one row of hidden_size values) the cache keeps between items
(CacheState.plp_hidden) — far smaller than that row's log-softmax over the vocabulary. Rows are projected
through the LM head and log-softmaxed SLICE_ROWS at a time, so a long chunk never holds a [chunk, vocab]
block of logits at once.

A cache also keeps a trail of the values it computed for its unsealed blocks (PromptLogprobTrail): when a
block fills and joins the prefix cache, its values and its last position's hidden state are stored beside it
(executor_service/kv/prompt_logprob_store.py), so a later prompt with that prefix gets them without recompute.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from executor_service.types import TokenOutput

SLICE_ROWS = 256  # rows projected and log-softmaxed at once: bounds the [rows, vocab] float32 buffers


@dataclass(frozen=True)
class LogprobRows:
    """Prompt logprobs of consecutive positions, on the host: per row the scored token, its logprob and rank,
    and `top` alternatives (ids and logprobs, best first)."""

    token_ids: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float32 [n]
    ranks: np.ndarray  # int64 [n]
    top_ids: np.ndarray  # int64 [n, top]
    top_logprobs: np.ndarray  # float32 [n, top]

    @property
    def top(self) -> int:
        return self.top_ids.shape[1]

    def __len__(self) -> int:
        return len(self.token_ids)

    def rows(self, a: int, b: int) -> "LogprobRows":
        return LogprobRows(self.token_ids[a:b], self.logprobs[a:b], self.ranks[a:b], self.top_ids[a:b],
                           self.top_logprobs[a:b])

    @staticmethod
    def empty(top: int) -> "LogprobRows":
        return LogprobRows(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64),
                           np.zeros((0, top), np.int64), np.zeros((0, top), np.float32))

    @staticmethod
    def cat(parts: list["LogprobRows"], top: int) -> "LogprobRows":
        """Concatenated, alternatives cut to `top` (every part has at least that many)."""
        if not parts:
            return LogprobRows.empty(top)
        return LogprobRows(np.concatenate([p.token_ids for p in parts]), np.concatenate([p.logprobs for p in parts]),
                           np.concatenate([p.ranks for p in parts]),
                           np.concatenate([p.top_ids[:, :top] for p in parts]),
                           np.concatenate([p.top_logprobs[:, :top] for p in parts]))

    def outputs(self, top: int) -> list[TokenOutput]:
        """As the domain's TokenOutputs, with at most `top` alternatives."""
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        tids, tlps = self.top_ids[:, :top].tolist(), self.top_logprobs[:, :top].tolist()
        return [TokenOutput(t, lp, list(zip(ti, tl)), rank=r) for t, lp, r, ti, tl in zip(ids, lps, ranks, tids, tlps)]


@torch.inference_mode()
def score(project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, top: int,
          vocab_size: int, slice_rows: int = SLICE_ROWS) -> LogprobRows:
    """hidden: [n, hidden_size] final hidden states; targets: [n] the token each row scores (on hidden's
    device). project: hidden -> float32 logits (the model's LM head). Logits past vocab_size (a padded LM
    head) are cut off, as the sampler cuts them."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for a in range(0, hidden.shape[0], slice_rows):
        lp = torch.log_softmax(project(hidden[a:a + slice_rows])[:, :vocab_size], dim=-1)  # [S, vocab]
        t = targets[a:a + slice_rows, None]
        got = lp.gather(1, t)  # [S, 1]
        rank = (lp > got).sum(dim=-1) + 1  # ties share the better rank
        tv, ti = lp.topk(top, dim=-1) if top else (lp[:, :0], t[:, :0])
        parts.append((t[:, 0], got[:, 0], rank, ti, tv))
    if not parts:
        return LogprobRows.empty(top)
    cols = [torch.cat(c).cpu().numpy() for c in zip(*parts)]
    return LogprobRows(cols[0].astype(np.int64), cols[1].astype(np.float32), cols[2].astype(np.int64),
                       cols[3].astype(np.int64), cols[4].astype(np.float32))


@dataclass(frozen=True)
class PromptLogprobTrail:
    """What a cache computed for its blocks not yet stored beside the prefix cache: rows of positions
    start .. start + len(rows) - 1, and the final hidden state of each block-end position among them (block
    index -> [hidden_size]). Replaced, never changed in place (a failed call puts the old one back)."""

    start: int
    rows: LogprobRows
    block_hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + len(self.rows)

    def block(self, index: int, block_size: int) -> tuple[LogprobRows, torch.Tensor] | None:
        """The rows of block `index` (its positions with a predecessor) and its last position's hidden state;
        None when the trail does not cover them."""
        first, last = max(index * block_size, 1), (index + 1) * block_size
        hidden = self.block_hidden.get(index)
        if hidden is None or first < self.start or last > self.end:
            return None
        return self.rows.rows(first - self.start, last - self.start), hidden

    def after_sealing(self, length: int, block_size: int) -> "PromptLogprobTrail":
        """The trail once every full block is stored (or not: prefix caching off): the partial last block."""
        keep = (length // block_size) * block_size
        cut = max(0, keep - self.start)
        return PromptLogprobTrail(max(self.start, keep), self.rows.rows(cut, len(self.rows)), {})


def extend_trail(trail: PromptLogprobTrail | None, start: int, rows: LogprobRows, hidden: torch.Tensor, pos: int,
                 block_size: int) -> PromptLogprobTrail:
    """The trail after a chunk at `pos` (hidden: [n, hidden_size] of its positions) scored rows from `start`:
    appended when it continues the trail with as many alternatives, else a new trail from start."""
    blocks = {(e + 1) // block_size - 1: hidden[e - pos] for e in range(pos, pos + hidden.shape[0])
              if (e + 1) % block_size == 0}
    if trail is not None and trail.end == start and trail.rows.top == rows.top:
        return PromptLogprobTrail(trail.start, LogprobRows.cat([trail.rows, rows], rows.top),
                                  {**trail.block_hidden, **blocks})
    return PromptLogprobTrail(start, rows, blocks)
