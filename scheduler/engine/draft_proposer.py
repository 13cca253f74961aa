"""Where draft tokens come from (speculative decoding): the DraftProposer interface and the n-gram
(prompt-lookup) proposer.

A proposer guesses the tokens that follow a sequence; the executor verifies them in the step's forward
(scheduler/engine/speculation.py decides how many to ask for). The interface is what a draft model or a suffix-tree
proposer would implement later: propose() for the sequence as it is now, forget() when it ends.

NgramProposer: the last n tokens of the sequence (prompt + output), for n from ngram_max down to ngram_min,
looked up among its earlier tokens; the tokens that followed the most recent earlier occurrence are the
draft. It wins where the output copies the input (editing, extraction, summaries, code changes, RAG). Each
sequence keeps an index n -> {n-gram: the position after its latest occurrence}, extended with the tokens
appended since the last call, so a proposal costs O(ngram_max - ngram_min + 1) dict look-ups however long
the sequence is (vLLM's prompt-lookup scans the whole sequence each step instead).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.engine.sequence import Sequence


class DraftProposer(Protocol):
    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to max_tokens (>= 1) tokens guessed to follow seq's tokens (prompt + output); [] = no guess."""
        ...

    def forget(self, seq: Sequence) -> None:
        """seq ended: drop what was kept for it."""
        ...


@dataclass
class _NgramIndex:
    indexed: int = 0  # tokens 0..indexed-1 have had their n-grams ending there recorded
    tables: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)  # n -> n-gram -> end position


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= --ngram-min ({ngram_min}) <= --ngram-max ({ngram_max})")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._index: weakref.WeakKeyDictionary[Sequence, _NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        length = seq.num_tokens
        if length <= self.ngram_min:
            return []
        index = self._index.get(seq)
        if index is None:
            index = self._index[seq] = _NgramIndex(tables={n: {} for n in range(self.ngram_min, self.ngram_max + 1)})
        # Only the tokens not indexed yet (and the n-grams reaching back from them) are read.
        lo = max(0, min(index.indexed, length) - self.ngram_max)
        recent = seq.token_slice(lo, length)  # tokens[lo:length]
        # Record the n-grams ending before the last token (the query must not find its own occurrence).
        for end in range(max(index.indexed, self.ngram_min), length):
            for n, table in index.tables.items():
                if end >= n:
                    table[tuple(recent[end - n - lo:end - lo])] = end
        index.indexed = max(index.indexed, length)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            start = index.tables[n].get(tuple(recent[len(recent) - n:]))
            if start is not None:
                return seq.token_slice(start, min(start + max_tokens, length))
        return []

    def forget(self, seq: Sequence) -> None:
        self._index.pop(seq, None)
