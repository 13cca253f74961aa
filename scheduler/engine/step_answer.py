"""The executor's answer to one step call, in the scheduler's terms: per item (ItemResult, converted from the
contract by scheduler/engine/executor_codec.py), with the pool's KV usage and the call's time (StepAnswer). What the policy
concludes from it is scheduler/output/step_outcome.py; the two are separate because the answer is the executor's
word, taken as it came, and the outcome is the policy's decision about the requests."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from scheduler.request import TokenLogprob
from tandem.errors import TandemError
from tandem.kv_usage import KvUsage


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
    pooled: tuple[float, ...] | None = None  # a pooled item's final chunk: its values (UnifiedResult.pooled)
    model_drafted: int = 0  # the executor's draft model's guesses verified for it (UnifiedResult.model_draft_tokens)


class StepAnswer(NamedTuple):
    """A whole step call's answer, as the engine applies it."""

    results: list[ItemResult]  # per item of the plan, in its order
    kv: KvUsage
    elapsed_s: float
    draft_model_s: float = 0.0  # of elapsed_s, the executor's time in its draft model (model drafts)
