"""Speculative decoding in the scheduler, piece by piece over real Sequence objects: the n-gram proposer
(against a brute-force search), the Speculator's adaptive draft length and cooldown, Sequence.draft_room,
the planner's draft budget (tokens and KV blocks), and the settings / CLI flags. (Steps against the
in-process executor: test_speculative_steps.py.)"""
from __future__ import annotations

import random

import pytest

from scheduler.__main__ import parse_args
from scheduler.config import SchedulerConfig
from scheduler.engine.draft_proposer import DraftProposer, NgramProposer
from scheduler.engine.planner import Planner
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence, Status
from scheduler.config import SpeculativeConfig
from scheduler.engine.speculation import Speculator, from_args
from tandem.ceil_div import ceil_div
from tandem.kv_usage import KvUsage
from tests.contract.test_ngram_match import direct_search

BS = 4  # tokens per KV block in the planner tests


def seq_of(prompt, outputs=(), max_new: int = 1000, min_new: int = 0, max_seq_len: int = 100_000,
           arrival: int = 0) -> Sequence:
    """A sequence holding prompt + outputs; decoding (all but its last output cached) when it has outputs."""
    s = Sequence(GenerateRequest(f"r{arrival}", tuple(prompt), StoppingCriteria(max_new, min_new)), arrival, [2],
                 max_seq_len)
    s.output_ids = list(outputs)
    if outputs:
        s.status, s.cache_id, s.num_cached = Status.RUNNING, f"c{arrival}", s.num_tokens - 1
    return s


# ------------------------------------------------------------------ the n-gram proposer


def test_ngram_prefers_the_longest_match_over_a_later_shorter_one():
    # "1 2 3" occurred at the start (then 10 11); "3" alone occurred later (then 20). The query ends "1 2 3".
    s = seq_of([1, 2, 3, 10, 11, 3, 20, 5, 1, 2], [3])
    assert NgramProposer(1, 3).propose(s, 2) == [10, 11]
    assert NgramProposer(1, 1).propose(s, 2) == [20, 5]  # only 1-grams: the latest "3"


def test_ngram_takes_the_latest_occurrence():
    s = seq_of([7, 8, 1, 7, 8, 2, 9, 7, 8, 3, 4, 7], [8])
    assert NgramProposer(2, 2).propose(s, 3) == [3, 4, 7]


def test_ngram_respects_max_tokens_and_the_sequence_end():
    s = seq_of([5, 6, 1, 2, 3, 4, 5], [6])
    p = NgramProposer(2, 3)
    assert p.propose(s, 1) == [1]
    assert p.propose(s, 3) == [1, 2, 3]
    assert p.propose(s, 100) == [1, 2, 3, 4, 5, 6]  # what followed, up to the sequence's end
    run = seq_of([4, 4, 4, 4])  # an occurrence overlapping the query: the one token after it
    assert NgramProposer(2, 3).propose(run, 5) == [4]


def test_ngram_proposes_nothing_without_a_match():
    assert NgramProposer(1, 4).propose(seq_of(list(range(3, 40))), 4) == []
    assert NgramProposer(2, 4).propose(seq_of([1, 2, 3, 1]), 4) == []  # "3 1" never occurred before
    assert NgramProposer(2, 4).propose(seq_of([1, 1]), 4) == []  # too short for a 2-gram and an earlier one
    assert NgramProposer(1, 4).propose(seq_of([1, 1]), 4) == [1]


def test_ngram_incremental_index_equals_a_fresh_search():
    """A sequence grown by 1-3 tokens between proposals (as decode steps with accepted drafts grow it): the
    proposer's incremental index gives what a fresh proposer and the brute-force search give, every time."""
    rng = random.Random(3)
    for ngram_min, ngram_max in [(1, 1), (1, 3), (2, 4), (3, 5)]:
        kept = NgramProposer(ngram_min, ngram_max)
        s = seq_of([rng.randrange(6) for _ in range(rng.randrange(1, 9))])
        for _ in range(150):
            k = rng.randrange(1, 7)
            tokens = s.token_slice(0, s.num_tokens)
            want = direct_search(tokens, ngram_min, ngram_max, k)
            assert kept.propose(s, k) == want == NgramProposer(ngram_min, ngram_max).propose(s, k), tokens
            s.output_ids.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def test_ngram_proposer_is_a_draft_proposer_and_forgets():
    p: DraftProposer = NgramProposer(1, 2)
    s = seq_of([1, 2, 1])
    assert p.propose(s, 2) == [2, 1]
    p.forget(s)
    s.output_ids = [9]
    assert p.propose(s, 2) == []  # rebuilt from the sequence as it is now
    with pytest.raises(ValueError, match="ngram-min"):
        NgramProposer(3, 2)


# ------------------------------------------------------------------ the Speculator


class FixedProposer:
    """A DraftProposer that always proposes max_tokens tokens, and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.forgotten: list[Sequence] = []

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        self.asked.append(max_tokens)
        return [9] * max_tokens

    def forget(self, seq: Sequence) -> None:
        self.forgotten.append(seq)


def lengths(spec: Speculator, seq: Sequence, steps: int, limit: int = 100) -> list[int]:
    return [len(spec.drafts(seq, limit)) for _ in range(steps)]


def test_speculator_adapts_the_draft_length():
    proposer = FixedProposer()
    spec = Speculator(SpeculativeConfig("ngram", num_tokens=4), proposer)
    s = seq_of(range(10, 20), [1])
    assert lengths(spec, s, 1) == [4]  # starts at --num-speculative-tokens
    spec.observe(s, 4, 4)
    assert lengths(spec, s, 1) == [4]  # fully accepted: +1, capped
    spec.observe(s, 4, 1)
    assert lengths(spec, s, 1) == [2]  # partly accepted: accepted + 1
    spec.observe(s, 2, 2)
    assert lengths(spec, s, 1) == [3]  # fully accepted: +1
    assert lengths(spec, s, 1, limit=2) == [2]  # never more than the step's room
    assert (s.drafted_tokens, s.accepted_tokens) == (10, 7)
    assert proposer.asked == [4, 4, 2, 3, 2]


def test_speculator_cools_down_after_rejections():
    spec = Speculator(SpeculativeConfig("ngram", num_tokens=5), FixedProposer())
    s = seq_of(range(10, 20), [1])
    assert lengths(spec, s, 1) == [5]

    def sits_out() -> int:  # steps without drafts before the next one (which is then 1 token)
        got = lengths(spec, s, 40)
        assert set(got[got.index(1):]) == {1} and set(got[:got.index(1)]) == {0}
        return got.index(1)

    spec.observe(s, 5, 0)  # nothing accepted: 1 token next, after sitting out 2 steps
    assert sits_out() == 2
    streak = []
    for _ in range(5):  # nothing accepted again and again: 4, 8, 16, 16, 16
        spec.observe(s, 1, 0)
        streak.append(sits_out())
    assert streak == [4, 8, 16, 16, 16]
    spec.observe(s, 1, 1)  # an accepted draft ends the streak: 2 tokens next
    assert lengths(spec, s, 1) == [2]
    spec.observe(s, 2, 0)  # a miss after it: 2 steps again
    assert sits_out() == 2
    spec.observe(s, 1, 0)
    assert sits_out() == 4
    spec.observe(s, 4, 1)  # partly accepted ends a streak too
    assert lengths(spec, s, 1) == [2]
    spec.observe(s, 2, 0)
    assert sits_out() == 2
    assert (s.drafted_tokens, s.accepted_tokens) == (5 + 5 + 1 + 2 + 1 + 4 + 2, 2)


def test_speculator_respects_draft_room_and_forgets():
    proposer = FixedProposer()
    spec = Speculator(SpeculativeConfig("ngram", num_tokens=4), proposer)
    short = seq_of(range(10, 20), [1], min_new=3)  # short of min_new_tokens: no drafts at all
    assert lengths(spec, short, 2) == [0, 0] and proposer.asked == []
    near_end = seq_of(range(10, 20), [1, 2], max_new=4)  # room for 1 draft + the sampled token
    assert lengths(spec, near_end, 1) == [1]
    s = seq_of(range(10, 20), [1])
    spec.observe(s, 4, 0)
    spec.drafts(s, 10)
    spec.forget(s)
    assert proposer.forgotten == [s]
    assert lengths(spec, s, 1) == [4]  # a fresh start: no cooldown, the full length


def test_step_allows_drafts_up_to_max_batch():
    spec = Speculator(SpeculativeConfig("ngram", max_batch=2), FixedProposer())
    assert [spec.step_allows_drafts(n) for n in range(4)] == [False, True, True, False]
    never = Speculator(SpeculativeConfig("ngram", max_batch=0), FixedProposer())
    assert not any(never.step_allows_drafts(n) for n in range(4))


# ------------------------------------------------------------------ Sequence.draft_room


def test_draft_room():
    assert seq_of(range(10), [1, 2], min_new=3).draft_room() == 0  # short of min_new_tokens
    assert seq_of(range(10), [1, 2, 3], min_new=3).draft_room() > 0
    # max_new_tokens 8 after 3 outputs: 5 more, so 4 drafts + the token sampled after them
    assert seq_of(range(10), [1, 2, 3], max_new=8).draft_room() == 4
    assert seq_of(range(10), [1, 2, 3], max_new=4).draft_room() == 0  # one token left: no draft
    # the model's length: 13 tokens of 15, so 1 draft + the sampled one
    assert seq_of(range(10), [1, 2, 3], max_seq_len=15).draft_room() == 1
    assert seq_of(range(10), [1, 2, 3], max_seq_len=13).draft_room() == 0  # never negative


# ------------------------------------------------------------------ the planner


def kv(free: int, total: int = 1000) -> KvUsage:
    return KvUsage(BS, total, free)


def planner(budget: int = 512, num_tokens: int = 4, max_batch: int = 8, proposer=None) -> Planner:
    p = Planner(budget, 8, 64)
    p.speculator = Speculator(SpeculativeConfig("ngram", num_tokens=num_tokens, max_batch=max_batch),
                              proposer or FixedProposer())
    return p


def drafts_of(plan) -> list[tuple[int, int]]:
    return [(i.seq.arrival, len(i.drafts)) for i in plan.items]


def test_planner_drafts_only_for_decoding_sequences():
    decoding = [seq_of(range(100, 110), [1, 2], arrival=a) for a in range(2)]
    prefilling = seq_of(range(100, 140), arrival=2)
    prefilling.status, prefilling.cache_id, prefilling.num_cached = Status.RUNNING, "c2", 8
    waiting = seq_of(range(200, 210), arrival=3)
    plan = planner().plan(decoding + [prefilling], [waiting], kv(500))
    assert drafts_of(plan) == [(0, 4), (1, 4), (2, 0), (3, 0)]
    assert [i.count for i in plan.items] == [1, 1, 32, 10]  # drafts ride on the decode item (count 1)
    assert plan.items[0].drafts == (9,) * 4


def test_planner_drafts_from_the_token_budget_before_prompts():
    decoding = [seq_of(range(100, 110), [1, 2], arrival=a) for a in range(3)]
    waiting = seq_of(range(200, 210), arrival=3)
    plan = planner(budget=8).plan(decoding, [waiting], kv(500))
    # 3 decode tokens, then 5 tokens of drafts: 4 for the oldest, 1 for the next; nothing left to admit
    assert drafts_of(plan) == [(0, 4), (1, 1), (2, 0)]
    assert plan.admitted == [] and "token budget" in plan.wait_reason


def test_planner_drafts_only_into_free_blocks():
    # 10 tokens cached (3 blocks of 4, 2 slots free in the last); the decode token takes one of them
    a = seq_of(range(100, 109), [1, 2], arrival=0)
    b = seq_of(range(100, 109), [1, 2], arrival=1)
    assert a.num_cached == 10
    plan = planner(num_tokens=8).plan([a, b], [], kv(free=1))
    # a: the slot left in its block + the one free block (4 slots) = 5 drafts; b: its own last slot only
    assert drafts_of(plan) == [(0, 5), (1, 1)]
    total_blocks = sum(ceil_div(i.seq.num_cached + 1 + len(i.drafts), BS) - ceil_div(i.seq.num_cached, BS)
                       for i in plan.items)
    assert total_blocks == 1
    assert drafts_of(planner().plan([a, b], [], kv(free=0))) == [(0, 1), (1, 1)]


def test_planner_no_drafts_past_max_batch_or_with_max_batch_zero():
    decoding = [seq_of(range(100, 110), [1, 2], arrival=a) for a in range(3)]
    assert drafts_of(planner(max_batch=3).plan(decoding, [], kv(500))) == [(0, 4), (1, 4), (2, 4)]
    assert drafts_of(planner(max_batch=2).plan(decoding, [], kv(500))) == [(0, 0), (1, 0), (2, 0)]
    assert drafts_of(planner(max_batch=0).plan(decoding, [], kv(500))) == [(0, 0), (1, 0), (2, 0)]
    plain = Planner(512, 8, 64)  # no speculator: no drafts
    assert drafts_of(plain.plan(decoding, [], kv(500))) == [(0, 0), (1, 0), (2, 0)]


def test_planner_with_the_ngram_proposer():
    """The default proposer: a decoding sequence whose output repeats its prompt gets the prompt's next
    tokens; one whose last tokens never occurred before gets none."""
    copying = seq_of([5, 6, 7, 8, 9, 10, 11], [5, 6, 7], arrival=0)
    fresh = seq_of([5, 6, 7, 8], [40, 41], arrival=1)
    p = Planner(512, 8, 64)
    p.speculator = Speculator(SpeculativeConfig("ngram", num_tokens=3, ngram_min=2, ngram_max=3))
    plan = p.plan([copying, fresh], [], kv(500))
    assert [i.drafts for i in plan.items] == [(8, 9, 10), ()]


# ------------------------------------------------------------------ settings


def test_config_validation():
    SpeculativeConfig().validate()
    assert SpeculativeConfig().enabled and SpeculativeConfig().method == "auto"  # on by default
    assert not SpeculativeConfig("off").enabled and SpeculativeConfig("ngram").enabled
    for bad, flag in [(dict(method="eagle"), "--speculative"), (dict(num_tokens=0), "--num-speculative-tokens"),
                      (dict(num_tokens=33), "--num-speculative-tokens"), (dict(ngram_min=0), "--ngram-min"),
                      (dict(ngram_min=3, ngram_max=2), "--ngram-max"), (dict(max_batch=-1), "--speculative-max-batch")]:
        with pytest.raises(ValueError, match=flag):
            SpeculativeConfig(**bad).validate()
        with pytest.raises(ValueError, match=flag):  # the scheduler's config checks it too
            SchedulerConfig("x:1", speculative=SpeculativeConfig(**bad)).validate()


def test_cli_flags():
    args = parse_args(["--executor", "x:1", "--speculative", "ngram", "--num-speculative-tokens", "6",
                       "--ngram-min", "1", "--ngram-max", "5", "--speculative-max-batch", "3"])
    assert from_args(args) == SpeculativeConfig("ngram", 6, 1, 5, 3)
    assert from_args(parse_args(["--executor", "x:1"])) == SpeculativeConfig()  # auto by default
    with pytest.raises(SystemExit):
        parse_args(["--executor", "x:1", "--speculative", "eagle"])


def test_a_step_refused_for_kv_with_drafts_is_retried_without_them_before_any_preemption():
    """Blocks held by another client of the executor: the step may fail only because of its drafts. The
    policy then plans the next step without drafts (no preemption); drafts resume on the step after."""
    from scheduler.engine.policy import SchedulingPolicy
    from tandem.errors import RemoteError
    cfg = SchedulerConfig("x", speculative=SpeculativeConfig("ngram", num_tokens=4))
    policy = SchedulingPolicy(cfg, kv(500))
    policy.speculator.proposer = FixedProposer()
    policy.planner.speculator = policy.speculator
    seqs = [seq_of(range(100, 110), [1, 2], arrival=a) for a in range(2)]
    policy.running = list(seqs)
    plan = policy.schedule()
    assert drafts_of(plan) == [(0, 4), (1, 4)]
    assert policy.step_failed(plan, RemoteError("RESOURCE_EXHAUSTED", "KV cache full"), kv_full=True) == []
    assert policy.running == seqs and policy.preemptions == 0  # nobody preempted for the drafts
    retry = policy.schedule()
    assert drafts_of(retry) == [(0, 0), (1, 0)]
    policy.step_failed(retry, RemoteError("RESOURCE_EXHAUSTED", "KV cache full"), kv_full=True)
    assert policy.preemptions == 1 and policy.running == seqs[:1]  # without drafts it is the blocks: preempt
    assert drafts_of(policy.schedule())[0] == (0, 4)  # drafts again (the preempted one is recomputed)
