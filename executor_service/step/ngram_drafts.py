"""Draft tokens the executor proposes itself inside a multi-step Decode (DecodeItem.ngram_drafts): prompt
lookup over the sequence's own tokens, which the cache records (CacheState.tokens), so a burst can draft at
every step from the tokens it has just sampled without a round trip to the scheduler.

The lookup is the scheduler's NgramProposer's (scheduler/engine/draft_proposer.py): the last n tokens, n from
ngram_max down to ngram_min, matched against the earlier tokens; the tokens after the latest earlier match
are the draft. Here it is one vectorised scan per step (numpy compares every window at once: a few tens of
microseconds for a few thousand tokens), with nothing kept between calls, since a cache's tokens may be
truncated or rolled back between them. Drafts never change the output (executor_service/step/batch.py verifies them as one token
per step would sample); they only change how many forwards the tokens take.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_DRAFT_TOKENS = 32  # per item and step (UnifiedItem.draft_token_ids too): more than a handful is rarely
# accepted, and each costs a KV slot and a logits row
MAX_NGRAM = 16


@dataclass(frozen=True)
class NgramDrafts:
    max_draft_tokens: int  # 1..MAX_DRAFT_TOKENS per step
    ngram_min: int  # >= 1
    ngram_max: int  # ngram_min..MAX_NGRAM

    def problem(self) -> str | None:
        """Why these settings are refused (INVALID_ARGUMENT), or None."""
        if not 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            return f"ngram_drafts.max_draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {self.max_draft_tokens}"
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            return (f"ngram_drafts needs 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}, got ngram_min "
                    f"{self.ngram_min}, ngram_max {self.ngram_max}")
        return None


def propose(tokens: Sequence[int], ngram_min: int, ngram_max: int, max_tokens: int) -> list[int]:
    """Up to max_tokens tokens that followed the latest earlier occurrence of the longest matching suffix of
    tokens (n in ngram_max..ngram_min); [] when none matches or max_tokens < 1."""
    length = len(tokens)
    if max_tokens < 1 or length <= ngram_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # Windows starting at 0 .. length-1-n: each ends before the last token, so the suffix never finds itself.
        windows = sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:min(start + max_tokens, length)].tolist()
    return []


class DraftLength:
    """One item's draft length across a call's steps: after a partly accepted draft, the accepted length + 1;
    after a fully accepted one, one more (up to the settings' maximum). A rejected guess costs a wider
    forward, so the length follows how well the sequence's lookups are doing."""

    def __init__(self, settings: NgramDrafts) -> None:
        self.settings = settings
        self.tokens = settings.max_draft_tokens

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        s = self.settings
        return propose(tokens, s.ngram_min, s.ngram_max, min(self.tokens, room))

    def observe(self, drafted: int, accepted: int) -> None:
        if accepted == drafted:
            self.tokens = min(self.settings.max_draft_tokens, self.tokens + 1)
        else:
            self.tokens = accepted + 1
