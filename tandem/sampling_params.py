"""Per-request sampling parameters (domain form of the contract's SamplingParams)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.errors import InvalidRequest

# Presence/frequency penalties follow the OpenAI range.
_PENALTY_RANGE = (-2.0, 2.0)
# Logit biases follow the OpenAI range: +-100 is already "always"/"never".
_BIAS_RANGE = (-100.0, 100.0)
# Alternatives reported per sampled token (top_logprobs), the same bound for both services (OpenAI's 20).
MAX_TOP_LOGPROBS = 20
# Temperatures below this are greedy: dividing logits by a subnormal temperature (1e-45) overflows them to
# inf, and the draw would then pick the lowest id of the tied infinities instead of the most likely token.
# At 1e-5 logits of magnitude <= 1e3 (+ a bias of 100) stay below 1e8: finite, and the draw is an argmax.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. Every field's zero value means "off", as in the proto.

    temperature: 0 = greedy (argmax of the penalised, biased logits); > 0 divides the logits. Below
        GREEDY_TEMPERATURE (1e-5) it is greedy too (a tinier one would overflow the logits).
    top_k: keep the k most likely tokens; 0 = off.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p; 0 or 1 = off.
    min_p: drop tokens whose probability is below min_p * max probability; 0 = off.
    repetition_penalty: transformers' multiplicative penalty over every token the sequence holds
        (prompt and output); 0 or 1 = off.
    presence_penalty / frequency_penalty: OpenAI's additive penalties over the output tokens only: those
        fed to a cache after its prompt (after Prefill, or after its first final UnifiedDecode chunk, or
        after the item's prompt_len when given: the scheduler sets it so a sequence recomputed after
        preemption still counts its earlier outputs as outputs).
    seed: makes sampling reproducible; None = a fresh random seed per step.
    logit_bias: token id -> value added to its logit before everything else.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty not in (0.0, 1.0)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest naming the first bad field."""
        def finite(name: str, value: float) -> None:
            if not math.isfinite(value):
                raise InvalidRequest(f"{{field}} must be a finite number, got {value}", f"sampling.{name}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise InvalidRequest(f"{{field}} must be >= 0 (0 = greedy), got {self.temperature}", "sampling.temperature")
        if self.top_k < 0:
            raise InvalidRequest(f"{{field}} must be >= 0 (0 = off), got {self.top_k}", "sampling.top_k")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidRequest(f"{{field}} must be in [0, 1] (0 = off), got {self.top_p}", "sampling.top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"{{field}} must be in [0, 1] (0 = off), got {self.min_p}", "sampling.min_p")
        if self.repetition_penalty < 0:
            raise InvalidRequest(f"{{field}} must be > 0 (0 or 1 = off), got {self.repetition_penalty}",
                                 "sampling.repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _PENALTY_RANGE[0] <= value <= _PENALTY_RANGE[1]:
                raise InvalidRequest(f"{{field}} must be in [-2, 2], got {value}", f"sampling.{name}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequest(f"{{field}} must be in [0, 2^64), got {self.seed}", "sampling.seed")
        for token_id, bias in self.logit_bias.items():
            if not 0 <= token_id < vocab_size:
                raise InvalidRequest(f"{{field}} names token {token_id}, outside the vocabulary [0, {vocab_size})",
                                     "sampling.logit_bias")
            finite("logit_bias", bias)
            if not _BIAS_RANGE[0] <= bias <= _BIAS_RANGE[1]:
                raise InvalidRequest(f"{{field}} of token {token_id} must be in [-100, 100], got {bias}",
                                     "sampling.logit_bias")
