"""The scheduler's side of draft-model speculation (scheduler/engine/speculation.py, step_cost.py): when a request
asks the executor's draft model for guesses, what it learns from their verification, and the keep rule with the
draft model's measured cost per guessed token."""
from __future__ import annotations

from scheduler.config import SpeculativeConfig
from scheduler.engine.speculation import DRAFT_MODEL, Speculator
from scheduler.engine.step_answer import ItemResult
from scheduler.output.step_outcome import StepOutcome
from scheduler.request import TokenLogprob
from tests.scheduler.test_suffix_speculation import seq_of


def answer(tokens: int, guessed: int) -> ItemResult:
    return ItemResult("c", 10, tuple(TokenLogprob(5, -1.0) for _ in range(tokens)), model_drafted=guessed)


def test_model_drafts_only_with_the_capability_and_the_method():
    seq = seq_of(range(10), [1])
    spec = Speculator(SpeculativeConfig("auto", num_tokens=4))
    assert spec.model_drafts(seq, 8) == 0  # the executor runs no draft model
    spec.draft_model = True
    assert spec.model_drafts(seq, 8) == 4 and spec.model_drafts(seq, 2) == 2  # --num-speculative-tokens, the room
    for method in ("ngram", "suffix"):
        other = Speculator(SpeculativeConfig(method))
        other.draft_model = True
        assert other.model_drafts(seq, 8) == 0
    only = Speculator(SpeculativeConfig(DRAFT_MODEL, num_tokens=4))
    only.draft_model = True
    assert only.drafts(seq_of([3, 4, 3, 4, 3], [4]), 4) == ()  # no lookup at all
    assert only.model_drafts(seq, 8) == 4


def test_verified_guesses_adapt_the_model_length_apart_from_the_lookups():
    spec = Speculator(SpeculativeConfig("auto", num_tokens=4))
    spec.draft_model = True
    seq = seq_of(range(10), [1])
    n = spec.model_drafts(seq, 8)
    out = StepOutcome()
    spec.settle(out, seq, (), answer(3, n))  # 2 of 4 guesses accepted, then the sampled token
    assert [(v.method, v.drafted, v.accepted) for v in out.verified] == [(DRAFT_MODEL, 4, 2)]
    assert (seq.drafted_tokens, seq.accepted_tokens) == (4, 2)
    assert spec.model_drafts(seq, 8) == 3  # accepted + 1
    assert spec.cost.acceptance is None and spec.model_cost.rate.acceptance == 0.5  # kept apart
    spec.settle(StepOutcome(), seq, (), answer(1, 3))  # none accepted: a cooldown of 2 steps
    assert [spec.model_drafts(seq, 8) for _ in range(3)] == [0, 0, 1]
    spec.settle(StepOutcome(), seq, (), answer(1, 0))  # asked, but the executor guessed nothing: no lesson
    assert seq.drafted_tokens == 7


def test_keep_counts_the_draft_models_measured_cost():
    spec = Speculator(SpeculativeConfig("auto"))
    spec.draft_model = True
    for n in (1, 2, 3, 6, 9) * 10:  # a = 20 ms, b = 1 ms per token
        spec.cost.step(n, 0.020 + 0.001 * n)
    good = seq_of(range(10), [1], arrival=1)
    spec.model_drafts(good, 8)
    for _ in range(6):
        spec.observe(good, 4, 4, model=True)  # its guesses all accepted
    spec.model_cost.observe(40, 0.040)  # 1 ms per guessed token: cheap next to a 21 ms step
    assert spec.keep(1, [(good, 4, True)]) == {0}
    spec.model_cost = type(spec.model_cost)()
    spec.model_cost.observe(4, 0.400)  # 100 ms per guess: 4 guesses cost 20 steps' time, never worth it
    assert spec.keep(1, [(good, 4, True)]) == set()
    assert spec.keep(1, [(good, 4, False)]) == {0}  # its lookups' own rate is unmeasured: they draft once


def test_step_fit_leaves_the_draft_models_time_out():
    spec = Speculator(SpeculativeConfig("auto"))
    seq = seq_of(range(10), [1])
    item = type("Item", (), {"count": 1, "drafts": (), "seq": seq})()
    out = StepOutcome()
    spec.settle(out, seq, (), answer(5, 4))
    spec.observe_step([item], 1, 0.5, out, draft_model_s=0.4)
    assert spec.model_cost.per_token == 0.1  # 0.4 s over 4 guesses
    assert spec.cost._t == 0.5 - 0.4 and spec.cost._n == 5  # the step: its token and 4 guesses, in 0.1 s
