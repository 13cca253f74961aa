"""When drafts pay, from measured step times: the batch-aware half of speculative decoding's adaptive rule.

A decode step's time grows with the tokens it carries, t(n) ~ a + b n (a: reading the weights and the call's
fixed costs; b: each token's compute). Drafting D tokens with acceptance rate p beside a batch of B decoding
sequences pays when it lowers the time per token produced: (a + b (B + D)) / (B + p D) < (a + b B) / B, which
for any D > 0 is B < a p / (b (1 - p)). So drafts stop paying at a batch size that depends only on the measured
ratio a / b (large on a GPU and for big models on a CPU: the weights dominate; small where the step is already
compute bound) and on how well drafts are being accepted.

StepCost fits a and b by least squares over recent single decode steps (exponentially weighted, so the fit
follows a machine that gets busier), and the acceptance rate as an exponentially weighted ratio. Until the steps
seen span a range of sizes the fit says nothing (None) and the caller keeps its fallback.

Acceptance differs between requests (a copy accepts most drafts, plain chat few), so the speculator decides per
request, not from one rate: worth() takes each candidate's draft length d and expected accepted tokens e (its
own acceptance history) and, best ratio e / d first, adds a candidate while it lowers the step's time per token
by at least 10% (_MARGIN), (a + b (B + D + d)) / (B + E + e) < 0.9 (a + b (B + D)) / (B + E) — without the margin,
the uniform-rate bound above is its special case.
"""
from __future__ import annotations

import math

_DECAY = 0.995  # per observation: the fit remembers roughly the last few hundred steps
_MIN_SPREAD = 0.5  # tokens: the weighted standard deviation of step sizes needed before b means anything
_MIN_WEIGHT = 8.0
# A draft must promise a time per token this much lower to be sent: the line is a rough fit (a step's cost is not
# linear far from the sizes seen, and a burst's per-call costs shift when its steps grow), and measured on/off
# runs lost 4-7% at 8 requests in flight where the exact rule drafted.
_MARGIN = 0.9


class StepCost:
    def __init__(self) -> None:
        self._w = self._n = self._t = self._nn = self._nt = 0.0  # weighted sums over (tokens, seconds)
        self._drafted = self._accepted = 0.0  # weighted, for the acceptance rate

    def step(self, tokens: float, seconds: float) -> None:
        """A decode step (or a burst's average step) carried `tokens` tokens and took `seconds`."""
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        d = _DECAY
        self._w = self._w * d + 1.0
        self._n = self._n * d + tokens
        self._t = self._t * d + seconds
        self._nn = self._nn * d + tokens * tokens
        self._nt = self._nt * d + tokens * seconds

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self._drafted = self._drafted * _DECAY + drafted
            self._accepted = self._accepted * _DECAY + accepted

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of t(n) = a + b n, or None while the steps seen do not tell them apart."""
        if self._w < _MIN_WEIGHT:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n < _MIN_SPREAD ** 2:
            return None
        b = (self._nt / self._w - mean_n * mean_t) / var_n
        a = mean_t - b * mean_n
        return (a, b) if a > 0 and b > 0 else None

    @property
    def acceptance(self) -> float | None:
        return self._accepted / self._drafted if self._drafted >= 1 else None



class DraftModelCost:
    """Seconds the executor's draft model spends per draft token it guesses (UnifiedDecodeResponse.draft_model_ms
    over the step's model draft tokens), exponentially weighted; None until measured. Per token as measured at
    the batch sizes seen: the draft model's forwards are shared by the items drafting in a step."""

    def __init__(self) -> None:
        self._w = self._s = 0.0
        self.rate = StepCost()  # (its acceptance rate only: the draft model's, apart from the lookups')

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0 and math.isfinite(seconds):
            self._w = self._w * _DECAY + tokens
            self._s = self._s * _DECAY + seconds

    @property
    def per_token(self) -> float | None:
        return self._s / self._w if self._w >= 1 else None


def worth(fit: tuple[float, float], batch: int, candidates: list[tuple[int, float, float]]) -> set[int]:
    """Which of `candidates` ((draft tokens d, expected accepted tokens e, seconds spent making the draft) each, by
    index) lower the time per token of a step of `batch` decoding sequences when their drafts join it, by
    t(n) = a + b n (fit) plus what making them costs (a draft model's time; 0 for a lookup)."""
    a, b = fit
    time, tokens = a + b * batch, float(batch)
    chosen: set[int] = set()
    for i in sorted(range(len(candidates)), key=lambda i: -candidates[i][1] / (max(1, candidates[i][0]) * b
                                                                               + candidates[i][2])):
        d, e, making = candidates[i]
        if d <= 0:
            continue
        if (time + b * d + making) * tokens >= _MARGIN * time * (tokens + e):  # not clearly lower time per token
            break
        time, tokens = time + b * d + making, tokens + e
        chosen.add(i)
    return chosen

