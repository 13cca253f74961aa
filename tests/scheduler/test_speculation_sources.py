"""Each draft source of a sequence (its own n-grams, earlier requests' outputs) keeps its own length, cooldown and
acceptance rate, and a sequence the measured cost rule refuses is tried again later: the two ways a copying
request used to stop drafting for good (a copy-heavy stream's speed then swung from run to run). Real Sequence
objects and the real proposers; the step costs fed as measured numbers."""
from __future__ import annotations

from scheduler.config import SpeculativeConfig
from scheduler.engine.speculation import Speculator
from scheduler.engine.suffix_proposer import NGRAM, SUFFIX
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence, Status

HEADER = [90, 91, 92]  # a chat template's "assistant" header: the end of every prompt
PASSAGE = list(range(200, 240))  # the text a copying request repeats


def seq_of(prompt, outputs=(), arrival: int = 0) -> Sequence:
    s = Sequence(GenerateRequest(f"r{arrival}", tuple(prompt), StoppingCriteria(1000)), arrival, [2], 100_000)
    s.output_ids = list(outputs)
    if outputs:
        s.status, s.cache_id, s.num_cached = Status.RUNNING, f"c{arrival}", s.num_tokens - 1
    return s


def measured(spec: Speculator) -> None:
    for n in (1, 2, 3, 6, 9) * 10:  # a = 20 ms a step, b = 1 ms a token
        spec.cost.step(n, 0.020 + 0.001 * n)


def test_a_failed_guess_from_an_earlier_answer_leaves_the_own_ngrams_drafting():
    """An earlier copy's answer starts like this one (the header, then 'The'): the index guesses its words, and
    they are wrong. The request's own n-grams (its prompt holds the passage) keep their length and rate."""
    spec = Speculator(SpeculativeConfig("suffix", num_tokens=8))
    spec.forget(seq_of([5, 6] + HEADER, [77] + list(range(300, 330))))  # an earlier answer: 'The' + other words
    copying = seq_of([1, 2] + PASSAGE + [3] + HEADER, [77])
    assert spec.drafts(copying, 100) == tuple(range(300, 308)) and spec.method(copying) == SUFFIX
    spec.observe(copying, 8, 0)  # all wrong: the earlier answers sit out, own n-grams untouched
    copying.output_ids += PASSAGE[:2]  # the model starts copying
    assert spec.drafts(copying, 100) == tuple(PASSAGE[2:10]) and spec.method(copying) == NGRAM
    assert spec.expected(copying, 8) > spec.expected(copying, 8, method=SUFFIX)
    spec.observe(copying, 8, 8)
    assert spec.cost.acceptance == 1.0 and spec.suffix_rate.acceptance == 0.0  # global rates apart too
    copying.output_ids += PASSAGE[2:11]
    assert spec.drafts(copying, 100) == tuple(PASSAGE[11:19])  # own length kept: 8 (its cap), no cooldown


def test_a_request_the_cost_rule_refuses_is_tried_again_later():
    """A copying request whose first drafts failed: its own rate says its drafts do not pay, so the rule refuses
    it; each refusal lets that rate fade toward the global one, so it is offered again within a few steps (never
    drafting again would leave the rate as it was for good). A request whose drafts keep failing beside a low
    global rate stays refused."""
    spec = Speculator(SpeculativeConfig("ngram", num_tokens=8))
    measured(spec)
    for _ in range(20):
        spec.cost.verified(8, 7)  # the global rate: most drafts are accepted (other copying requests)
    late = seq_of([1] + PASSAGE + HEADER, [7], arrival=0)
    spec.drafts(late, 100)
    spec.observe(late, 8, 0)  # its first draft failed entirely
    spec.observe(late, 8, 0)
    refusals = 0
    while not spec.keep(4, [(late, 8, False)]):
        refusals += 1
        assert refusals < 12, "a refused request must be offered again"
    assert refusals >= 1  # refused at first: the rule still weighs its failures

    spec.cost.verified(100_000, 0)  # the global rate near 0 now: fading toward it changes nothing
    failing = seq_of([1] + PASSAGE + HEADER, [7], arrival=1)
    spec.drafts(failing, 100)
    for _ in range(5):
        spec.observe(failing, 8, 0)
    assert not any(spec.keep(4, [(failing, 8, False)]) for _ in range(30))


def test_burst_drafting_weighs_the_own_ngram_rate():
    """Within a burst the executor drafts from the sequence's own tokens only: a failed guess from an earlier
    answer does not keep the sequence out of the burst's drafts."""
    spec = Speculator(SpeculativeConfig("suffix", num_tokens=8))
    measured(spec)
    spec.forget(seq_of([5, 6] + HEADER, [77] + list(range(300, 330))))
    copying = seq_of([1, 2] + PASSAGE + [3] + HEADER, [77])
    others = [seq_of([4] + HEADER, [50 + i], arrival=1 + i) for i in range(3)]
    spec.drafts(copying, 100)
    spec.observe(copying, 8, 0)  # the earlier answer's words: wrong
    copying.output_ids += PASSAGE[:2]
    for k in range(3):  # its own n-grams: right
        assert spec.drafts(copying, 100) and spec.method(copying) == NGRAM
        spec.observe(copying, 8, 8)
        copying.output_ids += PASSAGE[2 + 9 * k:11 + 9 * k]
    assert copying in spec.burst_drafting([copying] + others)


def test_the_draft_length_follows_the_measured_costs_and_the_rate():
    """Unmeasured: --num-speculative-tokens. Measured (20 ms a step, 1 ms a token): a request whose drafts are all
    accepted drafts the most; one whose drafts are cut after a token or so drafts 1-3, so that a miss costs few
    rows; a burst asks the executor for each one's own length."""
    spec = Speculator(SpeculativeConfig("ngram", num_tokens=8))
    copying, chatting = seq_of([1] + PASSAGE + HEADER, [7], arrival=0), seq_of([1] + HEADER, [7], arrival=1)
    assert spec.length(copying, NGRAM, 1) == 8
    measured(spec)
    for _ in range(6):
        spec.drafts(copying, 100), spec.drafts(chatting, 100)
        spec.observe(copying, 8, 8)
        spec.observe(chatting, 4, 1)  # a quarter accepted: p ~ 0.3
    assert spec.length(copying, NGRAM, 1) == 8 and spec.length(copying, NGRAM, 8) == 8
    assert 1 <= spec.length(chatting, NGRAM, 1) <= 3
    assert spec.length(chatting, NGRAM, 8) <= spec.length(chatting, NGRAM, 1)  # a bigger batch: no longer
    chatting.output_ids = [7, 1] + HEADER  # (something to look up, so a draft is proposed)
    assert 1 <= len(spec.drafts(chatting, 100)) <= spec.length(chatting, NGRAM, 1)
    drafting = spec.burst_drafting([copying, chatting])
    assert drafting[copying][0] == 8
    assert chatting not in drafting or drafting[chatting][0] == spec.length(chatting, NGRAM, 2)
