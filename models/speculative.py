"""Acceptance of draft tokens (speculative decoding) from the tokens sampled at their positions.

An item with drafts d_1..d_k gets k+1 sampled rows: row j holds the token the sampler drew after the item's
tokens and d_1..d_j (with the penalties and RNG key of that position). Draft d_{j+1} is accepted while it
equals row j's token; the item's output is rows 0..a (a = drafts accepted): the accepted drafts, then the
token drawn where the first draft failed (or after the last one).

Why this is the exact speculative-sampling rule for a deterministic draft (a draft that proposes d with
probability 1): the sampler draws with the exponential race (models/sampler.py), so P(row token = d) = p(d),
the target probability after every processor — the accept probability min(1, p(d)/q(d)) with q(d) = 1. And
given the race was not won by d, its winner is distributed as p with d removed and renormalised — the
rule's residual distribution max(0, p - q) / (1 - p(d)). So the output has exactly the distribution of one
token per step; greedy rows accept while the draft is the argmax; and a seeded request draws, at every
position, the same token it would have drawn without drafts (the key depends on seed and position only),
so its output is identical with speculation on or off.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def accepted_lengths(sampled: torch.Tensor, drafting: Sequence[tuple[int, int, Sequence[int]]]) -> list[int]:
    """sampled: [S] int64 token ids of every sampled row, on the device. drafting: per item with drafts,
    (item index, its first row in sampled, its draft ids). Returns each drafting item's accepted count, decided
    on the device (one small copy back)."""
    dev = sampled.device
    rows, drafts, segment = [], [], []
    for n, (_, first, ids) in enumerate(drafting):
        rows.extend(range(first, first + len(ids)))  # row j predicts draft j+1
        drafts.extend(ids)
        segment.extend([n] * len(ids))
    rows_t = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)  # [D]
    drafts_t = torch.tensor(drafts, dtype=torch.long).to(dev, non_blocking=True)  # [D]
    seg_t = torch.tensor(segment, dtype=torch.long).to(dev, non_blocking=True)  # [D]
    miss = (sampled.index_select(0, rows_t) != drafts_t).long()  # [D]
    # Misses up to and including each position, counted from its item's first draft: a draft is accepted
    # iff no draft of its item before it (nor itself) missed. Items' drafts are contiguous in D.
    run = miss.cumsum(0)  # [D]
    starts = torch.tensor([0] + [len(ids) for _, _, ids in drafting[:-1]]).cumsum(0).to(dev, non_blocking=True)
    before = run.index_select(0, starts) - miss.index_select(0, starts)  # [N] misses before each item's first
    ok = (run - before.index_select(0, seg_t)) == 0  # [D]
    accepted = torch.zeros(len(drafting), dtype=torch.long, device=dev).index_add_(0, seg_t, ok.long())  # [N]
    return accepted.tolist()
