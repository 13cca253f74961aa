"""Speculation inside multi-step Decode (DecodeItem.ngram_drafts), on the tiny fp32 Llama in process:
the executor drafts from each sequence's own tokens before every step and verifies the drafts in the step's
forward. Every test compares with the same Decode without ngram_drafts (plain decoding, one token per
forward): greedy and seeded sampling give identical tokens (and logprobs), the caches end at the same length
holding the same tokens (checked by decoding on from both), the drafts really ran (counts returned), and the
edges hold: a stop token among accepted drafts, max_tokens, the model's length limit, a KV pool that fills
mid-burst, a batch of several items, and the refusals of bad settings."""
from __future__ import annotations

import pytest

from executor_service.step.ngram_drafts import NgramDrafts
from executor_service.types import CacheRef, DecodeItem, OutputMode, OutputOptions, UnifiedItem
from tandem.errors import InvalidRequest, KvCapacityExceeded
from tandem.ngram_match import propose
from tandem.sampling_params import SamplingParams
from tests.executor_driver import make_executor, raising

DRAFTS = NgramDrafts(max_draft_tokens=6, ngram_min=1, ngram_max=3)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=7)
# Three tokens the tiny model then picks among in loops, which n-gram lookup predicts (accepted drafts).
LOOPING = SamplingParams(logit_bias={5: 8.0, 9: 8.0, 13: 8.0})
PENALISED = SamplingParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.1)
TOPS = OutputOptions(top_logprobs=2)


def looping(n: int, seed: int) -> list[int]:
    """A prompt repeating a short pattern: the tiny model's greedy output falls into loops that n-gram
    lookup predicts (so drafts are accepted), and sometimes leaves them (so some are rejected)."""
    pattern = [(seed * 37 + 11 * k) % 390 + 3 for k in range(3 + seed % 4)]
    return [1] + (pattern * 40)[:n]


PROMPTS = [looping(12, 0), looping(30, 1), looping(45, 2), looping(7, 3)]


@pytest.fixture(scope="module")
def ex(model_dir):
    return make_executor(model_dir, kv_blocks=256)


def start(ex, prompt: list[int], sampling: SamplingParams = SamplingParams()) -> tuple[str, int]:
    res = ex.prefill(prompt, sampling=sampling)
    return res.cache.cache_id, res.output.tokens[0].token_id


def burst(ex, prompt: list[int], steps: int, drafts: NgramDrafts | None, sampling: SamplingParams = SamplingParams(),
          stop: frozenset[int] = frozenset(), max_tokens: int = 0, output: OutputOptions = TOPS):
    """Prefill, then one Decode of `steps` steps: (cache id, first token, the Decode's result)."""
    cache_id, first = start(ex, prompt, sampling)
    (res,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, len(prompt)), first, sampling, output,
                                           stop_token_ids=stop, ngram_drafts=drafts, max_tokens=max_tokens)], steps))
    return cache_id, first, res


def ids(res) -> list[int]:
    return [t.token_id for t in res.output.tokens]


def continue_plain(ex, cache_id: str, seq_len: int, token: int, steps: int = 6) -> list[int]:
    """Decodes on from a cache: equal continuations from equal lengths mean the caches hold the same KV."""
    (res,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, seq_len), token)], steps))
    ex.release_cache([cache_id])
    return ids(res)


def assert_same_burst(ex, prompt, steps, sampling=SamplingParams(), stop=frozenset(), max_tokens=0):
    """The burst with drafts equals the burst without, tokens, logprobs and cache alike; returns the drafted
    result."""
    plain_id, first, plain = burst(ex, prompt, steps, None, sampling, stop, max_tokens)
    spec_id, first2, spec = burst(ex, prompt, steps, DRAFTS, sampling, stop, max_tokens)
    assert first == first2
    n = len(ids(plain))
    if max_tokens and n > max_tokens:  # plain decoding returns one token per step: cut it as the cap does
        n = max_tokens
    assert ids(spec) == ids(plain)[:n] and len(ids(spec)) == n
    for a, b in zip(spec.output.tokens, plain.output.tokens):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    assert spec.cache.seq_len == len(prompt) + n
    if plain.cache.seq_len == spec.cache.seq_len < ex.model_config.max_position_embeddings:
        last = ids(spec)[-1]
        assert continue_plain(ex, spec_id, spec.cache.seq_len, last) == continue_plain(ex, plain_id,
                                                                                      plain.cache.seq_len, last)
    else:
        ex.release_cache([spec_id, plain_id])
    return spec


def test_proposer_finds_the_latest_longest_match():
    assert propose([5, 6, 7, 8, 5, 6, 9, 5, 6], 1, 3, 4) == [9, 5, 6]  # "5 6" last seen before 9
    assert propose([5, 6, 7, 8, 5, 6, 9, 5, 6], 1, 3, 1) == [9]
    assert propose([1, 2, 3, 4], 1, 3, 4) == []  # nothing repeats
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], 3, 3, 5) == [3, 1, 2]  # "3 1 2" last seen at 2..4, then "3 1 2"
    assert propose([7, 7], 1, 2, 3) == [7]


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"len{len(p)}")
def test_greedy_burst_identical_with_drafts(ex, prompt):
    spec = assert_same_burst(ex, prompt, 24)
    assert spec.draft_tokens >= spec.accepted_draft_tokens >= 0
    assert spec.draft_steps <= 24


def test_drafts_are_accepted_and_save_forwards(ex):
    totals = [0, 0, 0]
    for prompt in PROMPTS:
        spec = assert_same_burst(ex, prompt, 32, LOOPING, max_tokens=32)
        totals = [totals[0] + spec.draft_steps, totals[1] + spec.draft_tokens, totals[2] + spec.accepted_draft_tokens]
    assert totals[0] > 0 and totals[2] > 0, totals  # the loops were predicted


@pytest.mark.parametrize("sampling", [LOOPING, SEEDED, PENALISED, SamplingParams(temperature=1.0, top_p=0.9, seed=3)],
                         ids=["looping", "seeded", "penalised", "top_p"])
def test_sampled_burst_identical_with_drafts(ex, sampling):
    for prompt in PROMPTS[:3]:
        assert_same_burst(ex, prompt, 20, sampling)


def test_stop_token_inside_accepted_drafts(ex):
    """Each token of the plain output as the stop token: the burst with drafts ends exactly there, with the
    cache holding the tokens before it; at least one of them ends inside an accepted run."""
    prompt = PROMPTS[0]
    _, _, plain = burst(ex, prompt, 24, None, LOOPING)
    inside = 0
    for stop in sorted(set(ids(plain)))[:8]:
        spec = assert_same_burst(ex, prompt, 24, LOOPING, stop=frozenset({stop}))
        assert ids(spec)[-1] == stop and stop not in ids(spec)[:-1]
        inside += spec.accepted_draft_tokens > 0
    assert inside


def test_one_step_decode_drafts_too(ex):
    """num_steps 1 with ngram_drafts: one forward, its draft verified, max_tokens bounding the tokens."""
    prompt = PROMPTS[0]
    _, _, plain = burst(ex, prompt, 12, None, LOOPING)
    cache_id, first = start(ex, prompt, LOOPING)
    got, pos, token, accepted = [], len(prompt), first, 0
    while len(got) < 12:
        (res,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, pos), token, LOOPING, ngram_drafts=DRAFTS,
                                               max_tokens=12 - len(got))], 1))
        got += ids(res)
        pos, token, accepted = res.cache.seq_len, got[-1], accepted + res.accepted_draft_tokens
        assert len(ids(res)) == 1 + res.accepted_draft_tokens
        assert pos == len(prompt) + len(got)
    assert got == ids(plain) and accepted > 0
    ex.release_cache([cache_id])


@pytest.mark.parametrize("cap", [1, 5, 13])
def test_max_tokens_caps_the_output(ex, cap):
    spec = assert_same_burst(ex, PROMPTS[0], 24, LOOPING, max_tokens=cap)
    assert len(ids(spec)) == cap


def test_model_length_limit_mid_burst(ex):
    """A cache a few tokens short of max_seq_len: drafts are cut to the room left, the item stops at it."""
    limit = ex.model_config.max_position_embeddings
    prompt = (PROMPTS[0] * (limit // len(PROMPTS[0]) + 1))[:limit - 9]
    spec = assert_same_burst(ex, prompt, 20)
    assert spec.cache.seq_len == limit and len(ids(spec)) == 9


def test_kv_pool_filling_mid_burst(model_dir):
    """A pool that cannot hold the drafts of later steps: the step runs without them, then the burst ends
    where plain decoding's does (partial results), with the same tokens."""
    small = make_executor(model_dir, kv_blocks=4)  # 64 tokens
    prompt = PROMPTS[2][:40]
    plain_id, first, plain = burst(small, prompt, 40, None)
    small.release_cache([plain_id])
    spec_id, first2, spec = burst(small, prompt, 40, DRAFTS)
    assert ids(spec) == ids(plain) and spec.cache.seq_len == plain.cache.seq_len == 64
    with pytest.raises(KvCapacityExceeded):
        raising(small.decode([DecodeItem(CacheRef(spec_id, 64), ids(spec)[-1], ngram_drafts=DRAFTS)], 4))


def test_batch_mixes_drafting_and_plain_items(ex):
    """Several items in one burst, some drafting, one with drafts and stop tokens: each item's tokens equal its
    plain burst's."""
    want = [ids(burst(ex, p, 16, None)[2]) for p in PROMPTS]
    items = []
    for k, p in enumerate(PROMPTS):
        cache_id, first = start(ex, p)
        items.append(DecodeItem(CacheRef(cache_id, len(p)), first, output=TOPS,
                                ngram_drafts=DRAFTS if k % 2 == 0 else None))
    got = raising(ex.decode(items, 16))
    assert [ids(r) for r in got] == want
    assert got[1].draft_tokens == got[3].draft_tokens == 0
    ex.release_cache([r.cache.cache_id for r in got])


@pytest.mark.parametrize("drafts, extra, message", [
    (NgramDrafts(0, 1, 3), {}, "max_draft_tokens"),
    (NgramDrafts(33, 1, 3), {}, "max_draft_tokens"),
    (NgramDrafts(4, 0, 3), {}, "ngram_min"),
    (NgramDrafts(4, 3, 2), {}, "ngram_min"),
    (NgramDrafts(4, 1, 17), {}, "ngram_max"),
    (DRAFTS, {"draft_token_ids": (5,)}, "exclude"),
    (DRAFTS, {"output": OutputOptions(OutputMode.TOKENS_AND_LOGITS)}, "logits"),
])
def test_bad_settings_fail_the_item_alone(ex, drafts, extra, message):
    cache_id, first = start(ex, PROMPTS[0])
    other_id, other_first = start(ex, PROMPTS[1])
    bad = DecodeItem(CacheRef(cache_id, len(PROMPTS[0])), first, ngram_drafts=drafts, **extra)
    good = DecodeItem(CacheRef(other_id, len(PROMPTS[1])), other_first, ngram_drafts=DRAFTS)
    steps = 1 if "draft_token_ids" in extra else 4  # (draft_token_ids with num_steps > 1 is refused anyway)
    res = ex.decode([bad, good], steps)
    assert isinstance(res[0].error, InvalidRequest) and message in str(res[0].error)
    assert res[1].error is None and len(ids(res[1])) >= steps
    assert res[0].draft_tokens == 0
    ex.release_cache([cache_id, other_id])
