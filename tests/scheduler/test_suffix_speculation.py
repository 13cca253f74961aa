"""Suffix decoding and the measured batch rule, piece by piece over real Sequence objects: the cross-request
index (ResponseIndex: longest match, the vote that stops where earlier outputs diverge, scopes that never mix,
its token bound and LRU eviction leaving no stale entry), the SuffixProposer over both sources, StepCost's fit,
the rule that keeps only the drafts lowering a step's time per token, and the Speculator deciding by it per request. (End to end over real processes:
tests/e2e/test_suffix_speculation.py.)"""
from __future__ import annotations

import random

import pytest

from scheduler.config import SpeculativeConfig
from scheduler.engine.draft_proposer import NgramProposer
from scheduler.engine.response_index import ResponseIndex
from scheduler.engine.speculation import Speculator, make_proposer
from scheduler.engine.step_cost import StepCost, worth
from scheduler.engine.suffix_proposer import NGRAM, SUFFIX, SuffixProposer, draft_scope
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence, Status

HEADER = [90, 91, 92]  # a chat template's "assistant" header: the end of every prompt


def seq_of(prompt, outputs=(), adapter: str = "", salt: str = "", arrival: int = 0) -> Sequence:
    req = GenerateRequest(f"r{arrival}", tuple(prompt), StoppingCriteria(1000), adapter=adapter, cache_salt=salt)
    s = Sequence(req, arrival, [2], 100_000)
    s.output_ids = list(outputs)
    if outputs:
        s.status, s.cache_id, s.num_cached = Status.RUNNING, f"c{arrival}", s.num_tokens - 1
    return s


# ------------------------------------------------------------------ ResponseIndex


def test_an_earlier_answer_is_drafted_from_the_prompt_header_on():
    idx = ResponseIndex(1000)
    answer = [10, 11, 12, 13, 14, 15, 16, 17]
    idx.record("s", [1, 2, 3] + HEADER, answer)
    # another prompt (another system prompt), the same header: the whole answer before any output of its own
    assert idx.propose("s", [7, 8, 9] + HEADER, 20) == (answer, 3)
    assert idx.propose("s", [7, 8, 9] + HEADER, 3) == (answer[:3], 3)
    # mid-answer: the rest of it; the match extends back over the header and the prompt's tail
    assert idx.propose("s", [5, 2, 3] + HEADER + answer[:4], 20) == (answer[4:], 8)
    assert idx.propose("s", [40, 41, 42], 20) == ([], 0)  # nothing like it
    assert idx.propose("s", [1, 2, 3] + HEADER, 0) == ([], 0)


def test_the_vote_follows_the_majority_and_stops_where_answers_diverge():
    idx = ResponseIndex(1000, min_share=0.5)
    idx.record("s", HEADER, [10, 11, 12, 20, 21])
    idx.record("s", HEADER, [10, 11, 12, 20, 22])
    idx.record("s", HEADER, [10, 11, 12, 30, 31])
    # all three agree on 10 11 12; then 20 has 2 of 3; then 21 and 22 have 1 of 2 each: a share of exactly
    # min_share is kept, so the draft may go on with either
    draft, n = idx.propose("s", HEADER, 10)
    assert draft[:4] == [10, 11, 12, 20] and n == 3
    strict = ResponseIndex(1000, min_share=0.6)
    for out in ([10, 11, 12, 20, 21], [10, 11, 12, 20, 22], [10, 11, 12, 30, 31]):
        strict.record("s", HEADER, out)
    assert strict.propose("s", HEADER, 10)[0] == [10, 11, 12, 20]  # 2/3 >= 0.6, then 1/2 < 0.6 stops
    strict.record("s", HEADER, [10, 11, 12, 30, 31])  # recorded again: counts twice in the vote
    assert strict.propose("s", HEADER, 10)[0] == [10, 11, 12]  # 20: 2 of 4, 30: 2 of 4: no majority


def test_the_longest_match_wins_over_more_recent_shorter_ones():
    idx = ResponseIndex(1000)
    idx.record("s", [1, 2], [50, 60, 70, 71, 72])
    idx.record("s", [3, 4], [9, 60, 70, 80, 81])  # later, but shares only "60 70" + nothing before
    # context "50 60 70": both outputs hold "60 70"... with ngram_min 3 the key is "50 60 70": only the first
    assert idx.propose("s", [50, 60, 70], 5)[0] == [71, 72]
    idx2 = ResponseIndex(1000, ngram_min=2)
    idx2.record("s", [1, 2], [50, 60, 70, 71, 72])
    idx2.record("s", [3, 4], [9, 60, 70, 80, 81])
    assert idx2.propose("s", [50, 60, 70], 5) == ([71, 72], 3)  # "50 60 70" beats the later "9 60 70"
    assert idx2.propose("s", [8, 60, 70], 5)[0] in ([71, 72], [80, 81])  # both match 2: the vote, a tie


def test_scopes_never_mix():
    idx = ResponseIndex(1000)
    idx.record(draft_scope(seq_of([1], salt="tenant-a")), HEADER, [10, 11, 12, 13])
    idx.record(draft_scope(seq_of([1], adapter="sql")), HEADER, [20, 21, 22, 23])
    assert idx.propose(draft_scope(seq_of([1], salt="tenant-a")), HEADER, 4)[0] == [10, 11, 12, 13]
    assert idx.propose(draft_scope(seq_of([1], adapter="sql")), HEADER, 4)[0] == [20, 21, 22, 23]
    for other in (seq_of([1]), seq_of([1], salt="tenant-b"), seq_of([1], adapter="sql", salt="tenant-a"),
                  seq_of([1], adapter="chat")):
        assert idx.propose(draft_scope(other), HEADER, 4) == ([], 0)


def test_the_token_bound_evicts_least_recently_used_and_leaves_no_stale_entry():
    rng = random.Random(0)
    idx = ResponseIndex(200, ngram_max=4)
    outputs = [[rng.randrange(100, 130) for _ in range(rng.randrange(5, 60))] for _ in range(60)]
    for i, out in enumerate(outputs):
        idx.record("s", [1, 2, 3, 4], out)
        assert idx.tokens <= 200
        assert idx.tokens == sum(len(o.tokens) for o in idx._outputs.values())
        live = set(idx._outputs)
        assert all(oid in live for hits in idx._hits.values() for oid, _ in hits)  # nothing points at evicted
        assert all(hits for hits in idx._hits.values())
    assert 0 < len(idx) < 60
    idx.record("s", [1], list(range(300, 600)))  # longer than the whole bound: not kept, nothing evicted
    assert idx.tokens <= 200 and len(idx) > 0
    empty = ResponseIndex(0)
    empty.record("s", HEADER, [1, 2, 3])
    assert len(empty) == 0 and empty.propose("s", HEADER, 3) == ([], 0)


def test_a_proposal_refreshes_what_it_used():
    idx = ResponseIndex(30, ngram_max=3)
    idx.record("s", [1, 2, 3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19])  # 13 tokens held
    idx.record("s", [4, 5, 6], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29])  # 26
    assert idx.propose("s", [1, 2, 3], 2)[0] == [10, 11]  # the first is now the most recently used
    idx.record("s", [7, 8, 9], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39])  # evicts the second, not the first
    assert idx.propose("s", [1, 2, 3], 2)[0] == [10, 11]
    assert idx.propose("s", [4, 5, 6], 2) == ([], 0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="tokens"):
        ResponseIndex(-1)
    with pytest.raises(ValueError, match="ngram_min"):
        ResponseIndex(10, ngram_min=4, ngram_max=3)


# ------------------------------------------------------------------ SuffixProposer


def test_suffix_proposer_records_ended_requests_and_drafts_the_repeat():
    proposer = SuffixProposer(NgramProposer(2, 4), ResponseIndex(10_000))
    a = seq_of([1, 2, 3] + HEADER, [40, 41, 42, 43, 44, 45, 46])
    proposer.propose(a, 4)
    proposer.forget(a)  # ended: its output is recorded
    b = seq_of([5, 6, 7] + HEADER, [], arrival=1)
    b.output_ids = [40]
    assert proposer.propose(b, 4) == [41, 42, 43, 44] and proposer.method(b) == SUFFIX
    # its own tokens draft when they give as much: a sequence repeating its prompt
    c = seq_of([60, 61, 62, 63, 64, 65, 66, 67, 68] + HEADER, [60, 61, 62], arrival=2)
    assert proposer.propose(c, 4) == [63, 64, 65, 66] and proposer.method(c) == NGRAM
    other = seq_of([5, 6, 7] + HEADER, [40], salt="x", arrival=3)  # another salt sees nothing of a's
    assert proposer.propose(other, 4) == [] and proposer.method(other) == NGRAM


def test_make_proposer_by_method():
    assert isinstance(make_proposer(SpeculativeConfig("ngram")), NgramProposer)
    for method in ("suffix", "auto"):
        p = make_proposer(SpeculativeConfig(method, suffix_cache_tokens=123))
        assert isinstance(p, SuffixProposer) and p.index.max_tokens == 123
    with pytest.raises(ValueError, match="--suffix-cache-tokens"):
        SpeculativeConfig("auto", suffix_cache_tokens=-1).validate()


# ------------------------------------------------------------------ StepCost and the batch rule


def test_step_cost_fits_the_line():
    cost = StepCost()
    assert cost.fit() is None and cost.acceptance is None
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randrange(1, 20)
        cost.step(n, 0.010 + 0.002 * n)
    a, b = cost.fit()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.002)
    cost.verified(10, 5)
    assert cost.acceptance == pytest.approx(0.5)
    cost.verified(1000, 1000)
    assert cost.acceptance == pytest.approx((5 * 0.995 + 1000) / (10 * 0.995 + 1000))  # older ones weigh less


def test_step_cost_needs_a_spread_of_sizes():
    cost = StepCost()
    for _ in range(100):
        cost.step(4, 0.02)
    assert cost.fit() is None
    cost.step(0, 1.0)  # ignored
    cost.step(3, float("nan"))
    assert cost.fit() is None


def test_worth_adds_drafts_while_they_lower_the_time_per_token():
    fit = (0.020, 0.001)  # 20 ms a step, 1 ms a token
    # uniform rate p: drafts pay below the batch a p / (b (1 - p)) (p = 0.3: 8.57), and are sent only where they
    # promise a 10% lower time per token: (a + b (B + d)) B < 0.9 (a + b B) (B + e) holds to B = 4 here
    p, d = 0.3, 4
    e = p * d  # (any e / d = p)
    assert worth(fit, 4, [(d, e, 0.0)]) == {0} and worth(fit, 5, [(d, e, 0.0)]) == set()
    # mixed: a copying request (3.5 of 4 accepted) drafts beside chat ones (0.2 of 4) that do not pay
    got = worth(fit, 8, [(4, 0.2, 0.0), (4, 3.5, 0.0), (4, 0.2, 0.0)])
    assert got == {1}
    assert worth(fit, 1, [(4, 0.0, 0.0)]) == set() and worth(fit, 1, [(0, 1.0, 0.0)]) == set()


def test_speculator_keeps_the_drafts_that_pay_by_each_requests_own_rate():
    spec = Speculator(SpeculativeConfig("auto"))
    copying, chatting = seq_of(range(10), [1], arrival=0), seq_of(range(10), [1], arrival=1)
    assert spec.keep(8, [(copying, 4, False), (chatting, 4, False)]) == {0, 1}  # unmeasured: the count rule alone
    assert spec.max_batch() == 4 and not spec.step_allows_drafts(5)
    for n in (1, 2, 3, 6, 9) * 10:  # a = 20 ms, b = 1 ms
        spec.cost.step(n, 0.020 + 0.001 * n)
    assert spec.max_batch() == 32  # measured: up to the cap, each step decides by keep()
    for _ in range(6):
        spec.drafts(copying, 4), spec.drafts(chatting, 4)
        spec.observe(copying, 4, 4)
        spec.observe(chatting, 4, 0)
    assert spec.expected(copying, 4) > 3 and spec.expected(chatting, 4) < 0.3
    assert spec.keep(8, [(copying, 4, False), (chatting, 4, False)]) == {0}
    assert spec.keep(5000, [(copying, 4, False)]) == set()  # a batch so large that even near-sure drafts cost more
    spec.cost.verified(100_000, 0)  # the global rate near 0: a request that never drafted still drafts once
    fresh = seq_of(range(10), [1], arrival=9)
    assert spec.keep(8, [(chatting, 4, False), (fresh, 4, False)]) == {1}
    fixed = Speculator(SpeculativeConfig("auto", max_batch=2))  # a number given: the count rule alone
    fixed.cost = spec.cost
    assert fixed.max_batch() == 2 and fixed.keep(2, [(chatting, 4, False)]) == {0}
    never = Speculator(SpeculativeConfig("auto", max_batch=0))
    assert not any(never.step_allows_drafts(n) for n in range(5))


def test_burst_drafting_by_the_same_rule():
    spec = Speculator(SpeculativeConfig("auto"))
    copying, chatting = seq_of(range(10), [1], arrival=0), seq_of(range(10), [1], arrival=1)
    assert set(spec.burst_drafting([copying, chatting])) == {copying, chatting}  # unmeasured
    for n in (1, 2, 3, 6, 9) * 10:
        spec.cost.step(n, 0.020 + 0.001 * n)
    for _ in range(6):
        spec.drafts(copying, 4), spec.drafts(chatting, 4)
        spec.observe(copying, 4, 4)
        spec.observe(chatting, 4, 0)
    batch = [copying, chatting] + [seq_of(range(10), [1], arrival=2 + i) for i in range(6)]
    assert copying in spec.burst_drafting(batch) and chatting not in spec.burst_drafting(batch)


def test_suffix_drafts_keep_the_step_single():
    spec = Speculator(SpeculativeConfig("suffix"))
    a = seq_of([1, 2, 3] + HEADER, [40, 41, 42, 43, 44, 45])
    spec.forget(a)
    b = seq_of([7, 7, 7] + HEADER, [40, 41], arrival=1)
    assert spec.drafts(b, 10) == (42, 43, 44, 45)
    assert spec.method(b) == SUFFIX and spec.needs_own_step(b)
    c = seq_of([9, 8, 9, 8, 9, 8] + HEADER, [9, 8], arrival=2)
    assert spec.drafts(c, 10) and not spec.needs_own_step(c)
    assert not Speculator(SpeculativeConfig("ngram")).needs_own_step(b)


def test_a_fully_accepted_suffix_draft_doubles():
    spec = Speculator(SpeculativeConfig("suffix", num_tokens=4))
    answer = list(range(40, 80))
    spec.forget(seq_of([1, 2, 3] + HEADER, answer))  # (recorded)
    b = seq_of([7, 7, 7] + HEADER, answer[:2], arrival=1)
    assert len(spec.drafts(b, 100)) == 4 and spec.method(b) == SUFFIX
    spec.observe(b, 4, 4)
    b.output_ids = answer[:7]
    assert len(spec.drafts(b, 100)) == 8
    spec.observe(b, 8, 8)
    b.output_ids = answer[:16]
    assert len(spec.drafts(b, 100)) == 16  # (4 x --num-speculative-tokens at most)
    spec.observe(b, 16, 16)
    b.output_ids = answer[:20]
    assert len(spec.drafts(b, 100)) == 16
    spec.observe(b, 16, 3)  # partly accepted: accepted + 1, as for n-grams
    assert len(spec.drafts(b, 100)) == 4
