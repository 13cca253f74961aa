"""The scheduler and the executor draft by one n-gram rule (tandem/ngram_match.py), in two forms: the
scheduler's NgramProposer keeps an incremental index per sequence, the executor's DraftLength scans the tokens
afresh each step. Over the same growing sequences both must give the drafts a direct search gives; a matcher
that takes another occurrence (the control case) must be caught by the same comparison."""
from __future__ import annotations

import random
from typing import Callable

from executor_service.step.ngram_drafts import DraftLength, NgramDrafts
from scheduler.engine.draft_proposer import NgramProposer
from scheduler.sequence import Sequence
from scheduler.request import GenerateRequest, StoppingCriteria
from tandem.ngram_match import NgramIndex, propose

RANGES = [(1, 1), (1, 3), (2, 4), (3, 5), (1, 16)]

Matcher = Callable[[list[int], int, int, int], list[int]]


def direct_search(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """The rule searched directly: for n from ngram_max down, the latest earlier occurrence (ending before the
    last token) of the last n tokens; the up to k tokens that followed it."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == tokens[length - n:]:
                return tokens[end:end + k]
    return []


def first_occurrence(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """A plausible wrong matcher: the earliest occurrence instead of the latest."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        for end in range(n, length):
            if tokens[end - n:end] == tokens[length - n:]:
                return tokens[end:end + k]
    return []


def disagreements(reference: Matcher, seed: int = 5, rounds: int = 120) -> list[str]:
    """Grows a random sequence (prompt, then 1-3 tokens per step, as accepted drafts grow it) and asks the
    scheduler's proposer (one index kept across the steps) and the executor's drafting (each step afresh) for
    drafts at every step; where either differs from `reference`, says so."""
    rng = random.Random(seed)
    problems: list[str] = []
    for ngram_min, ngram_max in RANGES:
        prompt = tuple(rng.randrange(5) for _ in range(rng.randrange(1, 12)))
        seq = Sequence(GenerateRequest("r", prompt, StoppingCriteria(10_000)), 0, [2], 100_000)
        scheduler = NgramProposer(ngram_min, ngram_max)
        for _ in range(rounds):
            k = rng.randrange(1, 9)
            tokens = seq.token_slice(0, seq.num_tokens)
            executor = DraftLength(NgramDrafts(max_draft_tokens=8, ngram_min=ngram_min, ngram_max=ngram_max))
            got = {"scheduler": scheduler.propose(seq, k), "executor": executor.propose(tokens, k)}
            want = reference(tokens, ngram_min, ngram_max, k)
            problems += [f"{side} {ngram_min}..{ngram_max} k={k} {tokens}: {draft} != {want}"
                         for side, draft in got.items() if draft != want]
            seq.output_ids.extend(rng.randrange(5) for _ in range(rng.randrange(1, 4)))
    return problems


def test_scheduler_and_executor_give_the_same_drafts():
    assert not disagreements(direct_search)


def test_the_two_forms_agree_on_a_sequence_kept_in_parts():
    # NgramIndex reads through token_slice (the scheduler's prompt + output); propose takes the tokens whole.
    rng = random.Random(11)
    tokens = [rng.randrange(4) for _ in range(400)]
    index = NgramIndex(2, 4)
    for length in range(1, len(tokens) + 1, 3):
        assert index.propose(length, lambda a, b: tokens[a:b], 5) == propose(tokens[:length], 2, 4, 5)


def test_the_comparison_catches_a_matcher_that_differs():
    assert disagreements(first_occurrence)  # control: the latest occurrence matters, and it is checked
