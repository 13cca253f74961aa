"""What a step gave back, in the scheduler's terms: the executor's answer per item (converted from the
contract by scheduler/rpc/codec.py), and what the policy concluded from it (tokens for live sequences, requests
that end with an error)."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Finish, TokenLogprob
from scheduler.engine.sequence import Sequence
from tandem.errors import TandemError


@dataclass(frozen=True)
class ItemResult:
    """The executor's answer for one item of a step (domain form of tandem.executor.v1.UnifiedResult)."""

    cache_id: str
    seq_len: int  # tokens the cache holds after the step
    # Sampled after a final chunk: one token, or with draft tokens the accepted drafts and the token after them.
    tokens: tuple[TokenLogprob, ...] = ()
    error: TandemError | None = None  # the item failed alone: nothing of it was written, its cache is as it was
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # when the item asked: its tokens after the sequence's first
    # A Decode burst whose executor drafted within it (DecodeItem.ngram_drafts): (steps that carried drafts,
    # draft tokens verified, accepted).
    burst_drafts: tuple[int, int, int] = (0, 0, 0)


@dataclass(frozen=True)
class Emitted:
    """A token a step gave a live sequence, and the stop it caused (None: the sequence goes on)."""

    seq: Sequence
    token: TokenLogprob
    finish: Finish | None


@dataclass(frozen=True)
class Failure:
    """A request the policy ended, and the error its client gets."""

    seq: Sequence
    error: TandemError


@dataclass
class StepOutcome:
    emitted: list[Emitted] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    drafts: int = 0  # items of the step that carried draft tokens (speculative decoding) ...
    drafted: int = 0  # ... their draft tokens ...
    accepted: int = 0  # ... and those accepted
