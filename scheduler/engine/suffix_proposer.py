"""Suffix decoding (--speculative suffix, and the default --speculative auto): drafts from the request's own
tokens (prompt + output, the n-gram rule of scheduler/engine/draft_proposer.py) and from the outputs of earlier
requests of the same scope (scheduler/engine/response_index.py), whichever proposes more tokens.

An ended request's output (finished, stopped, cancelled: every token of it is the model's) is recorded in the
index when the engine forgets the sequence. The scope is the adapter and the request's cache salt: requests that
could share prefix-cache blocks may share drafts, no others (response_index.py says why).
"""
from __future__ import annotations

import weakref

from scheduler.engine.draft_proposer import NgramProposer
from scheduler.engine.response_index import ResponseIndex
from scheduler.sequence import Sequence

NGRAM = "ngram"
SUFFIX = "suffix"


def draft_scope(seq: Sequence) -> str:
    """Which earlier outputs seq may draft from: those of its adapter and cache salt."""
    return f"{seq.request.adapter}\x00{seq.request.cache_salt}"


class SuffixProposer:
    def __init__(self, ngram: NgramProposer, index: ResponseIndex) -> None:
        self.ngram = ngram
        self.index = index
        # the method of each sequence's latest proposal (for metrics, and for bursts: the executor can only
        # make n-gram drafts within a burst)
        self._method: weakref.WeakKeyDictionary[Sequence, str] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, max_tokens: int, suffix_tokens: int | None = None) -> list[int]:
        """Up to max_tokens tokens from seq's own n-grams, or up to suffix_tokens (default max_tokens) from
        earlier outputs when those are more; 0 leaves that source out (the Speculator gives each source its own
        length and cooldown). The index is asked only when the own n-grams fall short."""
        other_max = max_tokens if suffix_tokens is None else suffix_tokens
        own = self.ngram.propose(seq, max_tokens) if max_tokens > 0 else []
        if other_max > 0 and (max_tokens <= 0 or len(own) < max_tokens):
            context = seq.token_slice(max(0, seq.num_tokens - self.index.ngram_max), seq.num_tokens)
            other, _ = self.index.propose(draft_scope(seq), context, other_max)
            if len(other) > len(own):
                self._method[seq] = SUFFIX
                return other
        self._method[seq] = NGRAM
        return own

    def method(self, seq: Sequence) -> str:
        """Where seq's latest drafts came from."""
        return self._method.get(seq, NGRAM)

    def forget(self, seq: Sequence) -> None:
        self.ngram.forget(seq)
        self._method.pop(seq, None)
        self.index.record(draft_scope(seq), seq.request.prompt_ids, seq.output_ids)
