"""N-gram (prompt-lookup) draft proposal: the one rule both processes draft by, in its two forms.

The rule: the last n tokens of the sequence, for n from ngram_max down to ngram_min, looked up among its
earlier tokens (an occurrence must end before the last token, so the suffix never finds itself); the tokens
that followed the latest earlier occurrence of the longest n that matches are the draft, up to max_tokens and
the sequence's end. It wins where the output copies the input (editing, extraction, summaries, code, RAG).

Two forms, because the two callers see their tokens differently:
- `propose` scans the tokens afresh each call (numpy compares every window at once: a few tens of
  microseconds for a few thousand tokens) and keeps nothing. The executor drafts this way inside a multi-step
  Decode (executor_service/step/ngram_drafts.py): a cache's tokens may be truncated or rolled back between
  calls, so nothing kept from an earlier call could be trusted.
- `NgramIndex` keeps, for one sequence that only grows, n -> {n-gram: the position after its latest
  occurrence}, extended with the tokens appended since the last call, so a proposal costs
  O(ngram_max - ngram_min + 1) dict look-ups however long the sequence is. The scheduler drafts this way
  (scheduler/engine/draft_proposer.py): its sequences only grow, and it proposes for every running sequence
  every step.
tests/contract/test_ngram_match.py checks that the two give the same drafts.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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


class NgramIndex:
    """`propose`'s rule over one sequence that only grows, indexed incrementally between calls."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.indexed = 0  # tokens 0..indexed-1 have had their n-grams ending there recorded
        # n -> n-gram -> the position just after its latest recorded occurrence
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}

    def propose(self, length: int, token_slice: Callable[[int, int], list[int]], max_tokens: int) -> list[int]:
        """What `propose` gives for the sequence's first `length` tokens; token_slice(start, stop) reads
        tokens[start:stop] (the caller's sequence may keep them in parts: prompt, then output)."""
        if max_tokens < 1 or length <= self.ngram_min:
            return []
        # Only the tokens not indexed yet (and the n-grams reaching back from them) are read.
        lo = max(0, min(self.indexed, length) - self.ngram_max)
        recent = token_slice(lo, length)
        # Record the n-grams ending before the last token (the query must not find its own occurrence).
        for end in range(max(self.indexed, self.ngram_min), length):
            for n, table in self.tables.items():
                if end >= n:
                    table[tuple(recent[end - n - lo:end - lo])] = end
        self.indexed = max(self.indexed, length)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            start = self.tables[n].get(tuple(recent[len(recent) - n:]))
            if start is not None:
                return token_slice(start, min(start + max_tokens, length))
        return []
