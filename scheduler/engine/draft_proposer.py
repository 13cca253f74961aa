"""Where draft tokens come from (speculative decoding): the DraftProposer interface and the n-gram
(prompt-lookup) proposer.

A proposer guesses the tokens that follow a sequence; the executor verifies them in the step's forward
(scheduler/engine/speculation.py decides how many to ask for). The interface is what a draft model or a suffix-tree
proposer would implement later: propose() for the sequence as it is now, forget() when it ends.

NgramProposer: prompt lookup over the sequence's own tokens (prompt + output), by the rule the executor drafts
by within a multi-step Decode too (tandem/ngram_match.py). Each sequence keeps an incremental index
(NgramIndex), so a proposal costs a few dict look-ups however long the sequence is (vLLM's prompt-lookup
scans the whole sequence each step instead).
"""
from __future__ import annotations

import weakref
from typing import Protocol

from scheduler.sequence import Sequence
from tandem.ngram_match import NgramIndex


class DraftProposer(Protocol):
    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to max_tokens (>= 1) tokens guessed to follow seq's tokens (prompt + output); [] = no guess."""
        ...

    def forget(self, seq: Sequence) -> None:
        """seq ended: drop what was kept for it."""
        ...


class NoProposer:
    """--speculative draft_model: no lookup; drafts come only from the executor's draft model."""

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        return []

    def forget(self, seq: Sequence) -> None:
        pass


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= --ngram-min ({ngram_min}) <= --ngram-max ({ngram_max})")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._index: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        index = self._index.get(seq)
        if index is None:
            index = self._index[seq] = NgramIndex(self.ngram_min, self.ngram_max)
        return index.propose(seq.num_tokens, seq.token_slice, max_tokens)

    def forget(self, seq: Sequence) -> None:
        self._index.pop(seq, None)
