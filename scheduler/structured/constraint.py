"""One sequence's place in its constraint's grammar: an llguidance matcher that has consumed exactly the
sequence's output tokens, and the packed mask of the token that may come next.

The matcher follows the output tokens, never the KV cache: a preempted sequence (cache released, recomputed
later) or one moved to another executor keeps its state, and if the tokens and the matcher ever disagree
(sync) the matcher is rebuilt from the output tokens. The scheduler's event loop advances it
(Sequence.append); masks are filled in the mask thread (scheduler/engine/token_masks.py), never at the same time.

A constraint may start later than the first token (starts_after: the answer of a model that thinks first,
scheduler/reasoning/): until the output ends with those token ids (e.g. </think>) it is dormant — no mask,
every token allowed, nothing consumed — and from the token after them on the grammar applies to the rest of
the output (`start`: where its tokens begin). This is how vLLM gates structured output behind reasoning.
"""
from __future__ import annotations

from typing import Sequence

import llguidance

from scheduler.structured.grammar import CompiledConstraint


class TokenConstraint:
    def __init__(self, compiled: CompiledConstraint, starts_after: tuple[int, ...] = ()) -> None:
        """starts_after: the token ids the output must end with before the grammar applies; () = at once."""
        self.compiled = compiled
        self.matcher: llguidance.LLMatcher = compiled.new_matcher()
        self.starts_after = starts_after
        self.start: int | None = None if starts_after else 0  # the output index of the grammar's first token
        self.consumed = 0  # output tokens (from `start` on) the matcher has consumed
        # The packed mask of the next token (after `consumed` tokens); None until computed (or while dormant)
        self.mask: bytes | None = compiled.initial_mask if self.active else None
        self.error = ""  # a token the grammar does not allow was appended: the matcher cannot go on

    @property
    def active(self) -> bool:
        """The grammar applies to the next token (false while waiting for starts_after)."""
        return self.start is not None

    @property
    def complete(self) -> bool:
        """No token may follow (the grammar is complete, or EOS was consumed where it could end)."""
        return not self.error and self.matcher.is_stopped()

    def advance(self, output_ids: Sequence[int]) -> bool:
        """The sequence appended output_ids[-1]: consume it. True when the grammar is now complete. A token the
        grammar refuses sets `error` (the executor did not apply the mask) and returns False."""
        if self.start is None:
            n = len(self.starts_after)
            if tuple(output_ids[-n:]) == self.starts_after:
                self.start, self.mask = len(output_ids), self.compiled.initial_mask
            return False
        if self.consumed != len(output_ids) - 1 - self.start:
            self.sync(output_ids[:-1])
        self.mask = None
        if not self.matcher.consume_token(output_ids[-1]):
            self.error = ("the executor sampled a token the request's constraint does not allow (does it apply "
                          "UnifiedItem.allowed_tokens?)")
            return False
        self.consumed += 1
        return self.matcher.is_stopped()

    def sync(self, output_ids: Sequence[int]) -> None:
        """Rebuilds the matcher from the output tokens (from `start` on) when it has not consumed exactly them."""
        if self.start is None:
            return  # dormant: nothing consumed
        tail = list(output_ids[self.start:])
        if self.consumed == len(tail) or self.error:
            return
        self.matcher = self.compiled.new_matcher()
        self.consumed = 0
        self.mask = None
        if not self.matcher.consume_tokens(tail):
            self.error = "the output tokens do not match the request's constraint"
            return
        self.consumed = len(tail)
