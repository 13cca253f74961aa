"""One sequence's place in its constraint's grammar: an llguidance matcher that has consumed exactly the
sequence's output tokens, and the packed mask of the token that may come next.

The matcher follows the output tokens, never the KV cache: a preempted sequence (cache released, recomputed
later) or one moved to another executor keeps its state, and if the tokens and the matcher ever disagree
(sync) the matcher is rebuilt from the output tokens. The scheduler's event loop advances it
(Sequence.append); masks are filled in the mask thread (scheduler/engine/token_masks.py), never at the same time.
"""
from __future__ import annotations

from typing import Sequence

import llguidance

from scheduler.structured.grammar import CompiledConstraint


class TokenConstraint:
    def __init__(self, compiled: CompiledConstraint) -> None:
        self.compiled = compiled
        self.matcher: llguidance.LLMatcher = compiled.new_matcher()
        self.consumed = 0  # output tokens the matcher has consumed
        # The packed mask of the next token (after `consumed` tokens); None until computed
        self.mask: bytes | None = compiled.initial_mask
        self.error = ""  # a token the grammar does not allow was appended: the matcher cannot go on

    @property
    def complete(self) -> bool:
        """No token may follow (the grammar is complete, or EOS was consumed where it could end)."""
        return not self.error and self.matcher.is_stopped()

    def advance(self, output_ids: Sequence[int]) -> bool:
        """The sequence appended output_ids[-1]: consume it. True when the grammar is now complete. A token the
        grammar refuses sets `error` (the executor did not apply the mask) and returns False."""
        if self.consumed != len(output_ids) - 1:
            self.sync(output_ids[:-1])
        self.mask = None
        if not self.matcher.consume_token(output_ids[-1]):
            self.error = ("the executor sampled a token the request's constraint does not allow (does it apply "
                          "UnifiedItem.allowed_tokens?)")
            return False
        self.consumed += 1
        return self.matcher.is_stopped()

    def sync(self, output_ids: Sequence[int]) -> None:
        """Rebuilds the matcher from the output tokens when it has not consumed exactly them."""
        if self.consumed == len(output_ids) or self.error:
            return
        self.matcher = self.compiled.new_matcher()
        self.consumed = 0
        self.mask = None
        if not self.matcher.consume_tokens(list(output_ids)):
            self.error = "the output tokens do not match the request's constraint"
            return
        self.consumed = len(output_ids)
