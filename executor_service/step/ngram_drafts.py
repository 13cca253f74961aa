"""Draft tokens the executor proposes itself inside a multi-step Decode (DecodeItem.ngram_drafts): prompt
lookup over the sequence's own tokens, which the cache records (CacheState.tokens), so a burst can draft at
every step from the tokens it has just sampled without a round trip to the scheduler.

The lookup is tandem/ngram_match.py's `propose`, the rule the scheduler's NgramProposer drafts by too, in
its stateless form: one vectorised scan per step with nothing kept between calls, since a cache's tokens may
be truncated or rolled back between them. Drafts never change the output (executor_service/step/batch.py
verifies them as one token per step would sample); they only change how many forwards the tokens take.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tandem.ngram_match import propose

MAX_DRAFT_TOKENS = 32  # per item and step (UnifiedItem.draft_token_ids too): more than a handful is rarely
# accepted, and each costs a KV slot and a logits row
MAX_NGRAM = 16


@dataclass(frozen=True)
class NgramDrafts:
    max_draft_tokens: int  # 1..MAX_DRAFT_TOKENS per step
    ngram_min: int  # >= 1
    ngram_max: int  # ngram_min..MAX_NGRAM

    def problem(self) -> tuple[str, str] | None:
        """Why these settings are refused (INVALID_ARGUMENT: a message writing `{field}`, and the field, a path
        under ngram_drafts), or None."""
        if not 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            return (f"{{field}} must be in 1..{MAX_DRAFT_TOKENS}, got {self.max_draft_tokens}",
                    "ngram_drafts.max_draft_tokens")
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            field = "ngram_drafts.ngram_min" if not 1 <= self.ngram_min <= MAX_NGRAM else "ngram_drafts.ngram_max"
            return (f"{{field}}: ngram_drafts needs 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}, got ngram_min "
                    f"{self.ngram_min}, ngram_max {self.ngram_max}", field)
        return None


class DraftLength:
    """One item's draft length across a call's steps: after a partly accepted draft, the accepted length + 1;
    after a fully accepted one, twice as long (up to the settings' maximum). A rejected guess costs a wider
    forward, so the length follows how well the sequence's lookups are doing; a copy runs on for tens of
    tokens once it is found, so a draft accepted whole doubles rather than creeping back one token a step
    (the spec benchmark's copy answers, replayed: 84 forwards at a maximum of 8, 100 growing by one to 4)."""

    def __init__(self, settings: NgramDrafts) -> None:
        self.settings = settings
        self.tokens = settings.max_draft_tokens

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        s = self.settings
        return propose(tokens, s.ngram_min, s.ngram_max, min(self.tokens, room))

    def observe(self, drafted: int, accepted: int) -> None:
        if accepted == drafted:
            self.tokens = min(self.settings.max_draft_tokens, 2 * self.tokens)
        else:
            self.tokens = accepted + 1
