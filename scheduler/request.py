"""A generation request in domain form (validated), and what streams back for it."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from scheduler.structured.grammar import CompiledConstraint
    from scheduler.vision.chat_images import PromptImage


@dataclass(frozen=True)
class StoppingCriteria:
    max_new_tokens: int  # resolved: never 0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False


@dataclass(frozen=True)
class PoolingSpec:
    """A request pooled instead of generated (embeddings and scores, scheduler/pooling/): what its prompt's final
    chunk returns in place of a token (the executor's UnifiedItem.pooling)."""

    task: str = "embed"  # embed | classify | token_logits
    type: str = "last"  # embed: last | mean (resolved from the model's default before the request is made)
    normalize: bool = False  # embed: L2-normalised by the executor
    token_ids: tuple[int, ...] = ()  # token_logits: whose logits at the last position

    @property
    def every_position(self) -> bool:
        """Mean pooling reads every position's hidden state: no prefix can be reused from the prefix cache."""
        return self.task == "embed" and self.type == "mean"


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    stopping: StoppingCriteria
    sampling: SamplingParams = SamplingParams()
    adapter: str = ""
    top_logprobs: int = 0
    keep_special_tokens: bool = False
    constraint: "CompiledConstraint | None" = None  # structured output (scheduler/structured/grammar.py); None = none
    prompt_logprobs: int | None = None  # alternatives per prompt token's logprob; None = no prompt logprobs
    cache_salt: str = ""  # vLLM's cache_salt: requests of other salts never draft from this one's output
    pooling: PoolingSpec | None = None  # pooled (embedding, score): one Delta with `pooled`, no token
    # The constraint applies after the output ends with these token ids (a thinking model's answer:
    # scheduler/reasoning/); () = from the first token
    constraint_after: tuple[int, ...] = ()
    # Images of a chat prompt (scheduler/vision/chat_images.py): pixels and placeholder spans, sent with the
    # chunks that cover each span
    images: tuple["PromptImage", ...] = ()
    # time.monotonic() when a front took the request, before tokenizing: --max-queue-time-s counts from it (a
    # wait for the tokenizer is a wait too); None = from its queueing
    received_at: float | None = None

    def choices(self, n: int) -> list["GenerateRequest"]:
        """n independent requests of this one (OpenAI's and vLLM's `n`): their own ids (`<id>-<i>`), and seed + i
        when it has a seed, so each choice is reproducible alone."""
        out = []
        for i in range(n):
            params = self.sampling
            if params.seed is not None and i:
                params = dataclasses.replace(params, seed=(params.seed + i) % 2**64)
            out.append(dataclasses.replace(self, request_id=f"{self.request_id}-{i}", sampling=params))
        return out


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens or the model's maximum length
    STOP = "stop"  # an EOS token or a stop token id, or the constraint is complete
    STOP_SEQUENCE = "stop_sequence"  # a stop string
    ABORTED = "aborted"  # ended by the server (shutdown)


@dataclass(frozen=True)
class Finish:
    """How a request ended: the reason, and for STOP the decimal id of the stop token, for STOP_SEQUENCE the
    stop string."""

    reason: FinishReason
    stop_reason: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    rank: int | None = None  # 1-based rank in the raw distribution: prompt logprobs only


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    preemptions: int = 0
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified ...
    accepted_tokens: int = 0  # ... and accepted (each saved a step)


@dataclass
class Delta:
    """What one stream message carries: new text and tokens since the previous message; finish_reason and
    usage on the last one only."""

    text: str = ""
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str = ""
    usage: Usage | None = None
    # On the first message of a request that asked: prompt positions 1 .. len - 1, each scored from the one
    # before (the first prompt token has none).
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # A pooled request's values (its only message, with finish_reason STOP): float32 embedding or scores.
    pooled: tuple[float, ...] | None = None

    def __bool__(self) -> bool:
        return bool(self.text or self.tokens or self.finish_reason)
