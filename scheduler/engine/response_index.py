"""Drafts across requests (suffix decoding): the outputs of recent requests, indexed by their n-grams, so that
a request whose output repeats an earlier one (a retry, a re-plan, the same question under another system
prompt, JSON that echoes an earlier answer) gets that earlier output as its drafts although its own prompt does
not contain it.

What is kept: each finished request's output, led by the last `ngram_max` tokens of its prompt (the chat
template's "assistant" header and what came before it, so that a new request finds the start of an earlier
answer before it has output a token of its own), per scope. A scope is what may see another's tokens: the same
adapter and the same cache salt (vLLM's `cache_salt`, which also isolates the prefix cache). Requests of one
scope never get drafts made of another scope's tokens, so a tenant whose requests carry their own salt cannot
learn from its drafts' speed what another tenant's model answered.

Bounded: at most `max_tokens` tokens over all scopes; the least recently used output goes first (an output
that is proposed from, or recorded again, becomes the most recent). An output recorded again (the same tokens in
the same scope) is not stored twice: its count grows, which weighs its continuation in the vote below.

Proposal (Arctic Inference's suffix decoding, on an n-gram index instead of a suffix tree): the sequence's last
`ngram_min` tokens look up their latest `max_hits` occurrences in the scope's outputs; each occurrence's match is
extended backwards (up to `ngram_max` tokens), and the longest matches are the candidates. The draft then follows
them token by token, each next token the one most candidates (weighted by their counts) continue with, stopping
where that token's share falls under `min_share` or the candidates run out. So a continuation that every earlier
answer agreed on is drafted long, and one where they diverged stops at the divergence. One index entry per token
held (~0.2 KB each): the default 131072 tokens take ~30 MB.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


@dataclass
class _Output:
    scope: str
    tokens: tuple[int, ...]  # the prompt's last tokens (lead-in), then the output
    count: int = 1  # times recorded


class ResponseIndex:
    def __init__(self, max_tokens: int, ngram_min: int = 3, ngram_max: int = 8, max_hits: int = 16,
                 min_share: float = 0.5) -> None:
        if max_tokens < 0:
            raise ValueError(f"the cross-request draft index holds >= 0 tokens, got {max_tokens}")
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({ngram_min}) <= ngram_max ({ngram_max})")
        self.max_tokens = max_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.max_hits = max_hits
        self.min_share = min_share
        self._outputs: OrderedDict[int, _Output] = OrderedDict()  # id -> output, least recently used first
        self._by_content: dict[tuple[str, tuple[int, ...]], int] = {}  # (scope, tokens) -> id
        # (scope, ngram_min tokens) -> [(output id, position after them)], latest last, at most max_hits
        self._hits: dict[tuple[str, tuple[int, ...]], list[tuple[int, int]]] = {}
        self._next_id = 0
        self.tokens = 0  # held now

    def __len__(self) -> int:
        return len(self._outputs)

    def record(self, scope: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """A request of `scope` ended having output `output` after `prompt`."""
        if not output or self.max_tokens <= 0:
            return
        tokens = tuple(prompt[max(0, len(prompt) - self.ngram_max):]) + tuple(output)
        if len(tokens) > self.max_tokens:
            return
        known = self._by_content.get((scope, tokens))
        if known is not None:
            self._outputs[known].count += 1
            self._outputs.move_to_end(known)
            return
        while self.tokens + len(tokens) > self.max_tokens:
            self._evict()
        oid, self._next_id = self._next_id, self._next_id + 1
        self._outputs[oid] = _Output(scope, tokens)
        self._by_content[(scope, tokens)] = oid
        self.tokens += len(tokens)
        for key, end in self._ngrams(scope, tokens):
            hits = self._hits.setdefault(key, [])
            hits.append((oid, end))
            if len(hits) > self.max_hits:
                del hits[0]

    def propose(self, scope: str, context: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """Up to max_tokens tokens that earlier outputs of `scope` continued `context` (a sequence's last
        tokens, at least ngram_max of them when it has that many) with, and the length of the n-gram matched
        (0: none)."""
        if max_tokens < 1 or not self._outputs:
            return [], 0
        tail = tuple(context[max(0, len(context) - self.ngram_max):])
        if len(tail) < self.ngram_min:
            return [], 0
        hits = self._hits.get((scope, tail[len(tail) - self.ngram_min:]))
        if not hits:
            return [], 0
        best, cands = 0, []
        for oid, end in hits:  # each occurrence's match, extended backwards
            out = self._outputs[oid]
            n = self.ngram_min
            while n < len(tail) and n < end and out.tokens[end - n - 1] == tail[len(tail) - n - 1]:
                n += 1
            if n > best:
                best, cands = n, []
            if n == best:
                cands.append((oid, end))
        return self._follow(cands, max_tokens), best

    def _follow(self, hits: list[tuple[int, int]], max_tokens: int) -> list[int]:
        cands = [(self._outputs[oid], end) for oid, end in hits]
        for oid, _ in hits:
            self._outputs.move_to_end(oid)
        draft: list[int] = []
        while len(draft) < max_tokens and cands:
            votes: dict[int, int] = {}
            weight = 0
            for out, end in cands:
                weight += out.count
                if end < len(out.tokens):
                    votes[out.tokens[end]] = votes.get(out.tokens[end], 0) + out.count
            if not votes:
                break
            token, support = max(votes.items(), key=lambda kv: kv[1])
            if support < self.min_share * weight:
                break
            draft.append(token)
            cands = [(out, end + 1) for out, end in cands if end < len(out.tokens) and out.tokens[end] == token]
        return draft

    def _ngrams(self, scope: str, tokens: tuple[int, ...]):
        """(scope, ngram_min tokens), the position after them: each such n-gram that a token follows."""
        n = self.ngram_min
        for end in range(n, len(tokens)):
            yield (scope, tokens[end - n:end]), end

    def _evict(self) -> None:
        oid, out = self._outputs.popitem(last=False)
        del self._by_content[(out.scope, out.tokens)]
        self.tokens -= len(out.tokens)
        for key, _ in self._ngrams(out.scope, out.tokens):
            hits = self._hits.get(key)
            if hits is None:
                continue
            hits[:] = [h for h in hits if h[0] != oid]
            if not hits:
                del self._hits[key]
