"""What the policy concluded from a step's answer (scheduler/engine/step_answer.py): the tokens it gave live
sequences (Emitted), the requests that end with an error (Failure) and the step's draft counts (StepOutcome).
The loop streams the tokens and reports the failures; nothing here is the executor's word any more."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Finish, TokenLogprob
from scheduler.sequence import Sequence
from tandem.errors import TandemError


@dataclass(frozen=True)
class Emitted:
    """A token a step gave a live sequence, and the stop it caused (None: the sequence goes on)."""

    seq: Sequence
    token: TokenLogprob
    finish: Finish | None


@dataclass(frozen=True)
class Pooled:
    """A pooled sequence's values (its final chunk ran): it has ended."""

    seq: Sequence
    values: tuple[float, ...]


@dataclass(frozen=True)
class Failure:
    """A request the policy ended, and the error its client gets."""

    seq: Sequence
    error: TandemError


@dataclass(frozen=True)
class Verified:
    """Drafts of one sequence that a step verified: where they came from ("ngram", "suffix", "draft_model": the
    executor's draft model; "ngram_burst": the executor's, within a multi-step burst, `steps` drafts summed),
    their tokens and the accepted ones."""

    method: str
    drafted: int
    accepted: int
    steps: int = 1


@dataclass
class StepOutcome:
    emitted: list[Emitted] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    pooled: list[Pooled] = field(default_factory=list)
    drafts: int = 0  # items of the step that carried draft tokens (speculative decoding) ...
    drafted: int = 0  # ... their draft tokens ...
    accepted: int = 0  # ... and those accepted
    verified: list[Verified] = field(default_factory=list)  # the same, by sequence and method
    seconds: float = 0.0  # the step's call, send to answer (the engine sets it)
