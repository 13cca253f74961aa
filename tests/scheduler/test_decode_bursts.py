"""Multi-step decode (scheduler/engine/decode_bursts.py): when a step is only decodes and nothing waits, the engine
asks the executor for several decode steps in one Decode call. The rules that keep a burst to one step, and
over the real in-process executor: the tokens, logprobs and stops of bursts are those of one step per call,
a burst never passes max_new_tokens nor the free blocks, a stop string inside a burst ends the text there,
a request arriving during bursts is served, a recomputed sequence keeps its penalties, a refused burst
halves the cap and changes no sequence, and every block is free at the end."""
from __future__ import annotations

import asyncio
import random

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler.structured.constraint import TokenConstraint
from scheduler.config import BurstConfig
from scheduler.engine.decode_bursts import DecodeBursts
from scheduler.engine.planner import StepItem, StepPlan
from scheduler.request import Delta, FinishReason, GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence
from scheduler.engine.speculation import SpeculativeConfig, Speculator
from scheduler.text.tokenizer import ModelTokenizer
from tandem.capabilities import MULTI_STEP_DECODE, MULTI_STEP_DRAFTS
from tandem.kv_usage import KvUsage
from tandem.sampling_params import SamplingParams
from tests.executor_driver import make_executor
from tandem.errors import RemoteError
from tests.scheduler.engine_harness import Running, collect, tokens, until
from tests.scheduler.test_scheduling_policy import new_policy, step, submit

PROMPTS = ((1, 5, 9, 33, 44, 100, 7, 250, 17, 3), (8, 8, 120, 64, 31, 200, 11, 40, 41, 2, 19, 77),
           (300, 301, 5, 6, 7), (12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28))
FAST = {"bursts": BurstConfig(window_ms=60_000, max_steps=8)}  # every burst as long as the rules allow
OFF = {"bursts": BurstConfig(window_ms=0)}
CAPS = (MULTI_STEP_DECODE,)
SPEC = Speculator(SpeculativeConfig("ngram", num_tokens=5, ngram_min=2, ngram_max=20))


class Recording:
    """The in-process client, counting the Decode calls and their num_steps (everything else passes)."""

    def __init__(self, inner: InProcessExecutorClient) -> None:
        self.inner, self.address, self.bursts = inner, inner.address, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def decode(self, items, num_steps, session_id="", release=()):
        self.bursts.append((len(items), num_steps))
        return await self.inner.decode(items, num_steps, session_id, release=release)


def kv(free: int = 100) -> KvUsage:
    return KvUsage(total_blocks=100, free_blocks=free, block_size=16)


def decoding(max_new: int = 50, out: int = 3, **stop) -> Sequence:
    seq = Sequence(GenerateRequest("r", tuple(range(10)), StoppingCriteria(max_new, **stop)), 0, (2,), 4096)
    seq.output_ids = list(range(100, 100 + out))
    seq.num_cached = seq.num_tokens - 1
    seq.cache_id = "c"
    seq.registered_sampling = seq.sampling_for_next_token()  # a final item was applied to the cache
    return seq


def plan_of(*seqs: Sequence) -> StepPlan:
    return StepPlan(items=[StepItem(s, s.num_cached, 1) for s in seqs])


def measured(step_ms: float, window_ms: float = 100, max_steps: int = 16) -> DecodeBursts:
    bursts = DecodeBursts(BurstConfig(window_ms, max_steps))
    bursts.observe(plan_of(decoding()), 1, step_ms / 1e3)
    return bursts


def test_a_burst_takes_the_steps_whose_time_is_closest_to_its_window():
    assert measured(25).steps(plan_of(decoding()), False, kv(), CAPS, None) == 4
    assert measured(30).steps(plan_of(decoding()), False, kv(), CAPS, None) == 3  # 90 ms, not 120
    assert measured(60).steps(plan_of(decoding()), False, kv(), CAPS, None) == 2  # 120 ms is closer than 60
    assert measured(70).steps(plan_of(decoding()), False, kv(), CAPS, None) == 1  # 70 ms is closer than 140
    assert measured(5).steps(plan_of(decoding()), False, kv(), CAPS, None) == 16  # --max-decode-steps
    assert measured(250).steps(plan_of(decoding()), False, kv(), CAPS, None) == 1  # a slow model: one step
    assert DecodeBursts(BurstConfig()).steps(plan_of(decoding()), False, kv(), CAPS, None) == 1  # not measured


def test_speculation_rides_in_bursts_where_the_executor_drafts():
    """With multi_step_drafts, a speculating scheduler's decode-only plan becomes a burst: the planner's drafts
    leave the plan, the items ask the executor for n-gram drafts (ngram_max cut to the contract's 16) with
    max_tokens = the tokens left; a constrained sequence gets none, nor does any above --speculative-max-batch."""
    b, caps = measured(10), CAPS + (MULTI_STEP_DRAFTS,)
    seq, constrained = decoding(max_new=40, out=3), decoding()
    constrained.constraint = object.__new__(TokenConstraint)
    plan = StepPlan(items=[StepItem(seq, 12, 1, (5, 6)), StepItem(decoding(), 12, 1)])
    assert b.steps(plan, False, kv(), caps, SPEC) == 10
    assert [item.drafts for item in plan.items] == [(), ()]
    items = b.to_pb(plan)
    assert [(i.ngram_drafts.max_draft_tokens, i.ngram_drafts.ngram_min, i.ngram_drafts.ngram_max) for i in items] \
        == [(5, 2, 16)] * 2
    assert items[0].max_tokens == seq.tokens_left == 37
    with_constrained = StepPlan(items=[StepItem(seq, 12, 1), StepItem(constrained, 12, 1)])
    assert b.steps(with_constrained, False, kv(), caps, SPEC) == 1  # (constrained: single steps anyway)
    many = StepPlan(items=[StepItem(decoding(), 12, 1) for _ in range(5)])  # above max_batch 4
    assert b.steps(many, False, kv(), caps, SPEC) == 10
    assert not any(i.HasField("ngram_drafts") or i.max_tokens for i in b.to_pb(many))


def test_what_keeps_a_step_single():
    b = measured(10)
    assert b.steps(plan_of(decoding()), False, kv(), CAPS, None) == 10
    assert b.steps(plan_of(decoding()), True, kv(), CAPS, None) == 1  # a request waits
    assert b.steps(plan_of(decoding()), False, kv(), (), None) == 1  # the executor cannot
    assert b.steps(plan_of(decoding()), False, kv(), CAPS, SPEC) == 1  # drafts, and no multi_step_drafts
    assert b.steps(plan_of(decoding(min_new_tokens=5)), False, kv(), CAPS, None) == 1  # EOS still banned
    prompt = decoding()
    assert b.steps(StepPlan(items=[StepItem(prompt, 0, 4)]), False, kv(), CAPS, None) == 1  # a prompt chunk
    drafted = StepPlan(items=[StepItem(decoding(), 12, 1, (5, 6))])
    assert b.steps(drafted, False, kv(), CAPS, None) == 1
    constrained = decoding()
    constrained.constraint = object.__new__(TokenConstraint)
    assert b.steps(plan_of(constrained), False, kv(), CAPS, None) == 1
    assert measured(10, window_ms=0).steps(plan_of(decoding()), False, kv(), CAPS, None) == 1
    recomputed = decoding()  # its reused prefix holds all but its last token: the executor lacks its prompt end
    recomputed.drop_cache()
    recomputed.adopt_prefix("c", recomputed.num_tokens - 1)
    assert recomputed.is_decoding and b.steps(plan_of(recomputed), False, kv(), CAPS, None) == 1


def test_a_burst_stops_at_max_new_tokens_and_at_the_free_blocks():
    b = measured(1)
    assert b.steps(plan_of(decoding(max_new=6, out=3), decoding()), False, kv(), CAPS, None) == 3
    # 13 tokens cached: 3 more fill the first block; each of 4 sequences needs a block for a 4th step
    four = [decoding(out=4) for _ in range(4)]
    assert b.steps(plan_of(*four), False, kv(free=0), CAPS, None) == 3
    assert b.steps(plan_of(*four), False, kv(free=4), CAPS, None) == 16
    # prompt chunks' steps do not teach the step time
    b.observe(StepPlan(items=[StepItem(decoding(), 0, 9)]), 1, 5.0)
    assert b.steps(plan_of(decoding()), False, kv(), CAPS, None) == 16


@pytest.fixture
def client(model_dir):
    return Recording(InProcessExecutorClient(make_executor(model_dir, kv_blocks=64, prefix_caching=False)))


def requests() -> list[GenerateRequest]:
    greedy = [GenerateRequest(f"g{i}", p, StoppingCriteria(12 + 3 * i, ignore_eos=True), top_logprobs=i % 3)
              for i, p in enumerate(PROMPTS)]
    sampled = GenerateRequest("s", PROMPTS[0], StoppingCriteria(15, ignore_eos=True),
                              SamplingParams(temperature=0.9, top_k=40, seed=7, repetition_penalty=1.3,
                                             presence_penalty=0.5))
    stops = GenerateRequest("t", PROMPTS[1], StoppingCriteria(20, stop_token_ids=frozenset()))
    return greedy + [sampled, stops]


async def run_all(client, tokenizer, reqs: list[GenerateRequest], **cfg) -> dict[str, list]:
    async with Running(client, tokenizer, **cfg) as engine:
        outs = {r.request_id: engine.submit(r)[1] for r in reqs}
        return {rid: await collect(out) for rid, out in outs.items()}


def summary(events) -> tuple:
    deltas = [e for e in events if isinstance(e, Delta)]
    lps = [(t.token_id, round(t.logprob, 4), tuple((i, round(v, 4)) for i, v in t.top)) for d in deltas
           for t in d.tokens]
    return lps, "".join(d.text for d in deltas), deltas[-1].finish_reason


def test_bursts_give_what_single_steps_give(client, model_dir):
    tokenizer = ModelTokenizer(model_dir)
    single = asyncio.run(run_all(client, tokenizer, requests(), **OFF))
    assert not client.bursts
    burst = asyncio.run(run_all(client, tokenizer, requests(), **FAST))
    assert client.bursts and max(steps for _, steps in client.bursts) > 1
    for rid in single:
        assert summary(burst[rid]) == summary(single[rid]), rid
    assert all(summary(burst[r.request_id])[2] is FinishReason.LENGTH for r in requests() if r.request_id[0] == "g")
    assert max(len(e.tokens) for e in burst["g0"] if isinstance(e, Delta)) > 1  # one message per burst


def test_a_stop_string_inside_a_burst_ends_the_text_there(client, model_dir):
    tokenizer = ModelTokenizer(model_dir)
    plain = GenerateRequest("p", PROMPTS[3], StoppingCriteria(24, ignore_eos=True))
    text = summary(asyncio.run(run_all(client, tokenizer, [plain], **OFF))["p"])[1]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), "the tiny model's text has no usable middle"
    req = GenerateRequest("p", PROMPTS[3], StoppingCriteria(24, stop=(stop,), ignore_eos=True))
    single = summary(asyncio.run(run_all(client, tokenizer, [req], **OFF))["p"])
    burst = summary(asyncio.run(run_all(client, tokenizer, [req], **FAST))["p"])
    assert burst[1:] == single[1:] and single[2] is FinishReason.STOP_SEQUENCE
    assert burst[1] == text[:text.index(stop)]


def test_a_request_arriving_during_bursts_is_served(client, model_dir):
    tokenizer = ModelTokenizer(model_dir)
    first = GenerateRequest("a", PROMPTS[0], StoppingCriteria(40, ignore_eos=True))
    late = GenerateRequest("b", PROMPTS[2], StoppingCriteria(10, ignore_eos=True))
    want = asyncio.run(run_all(client, tokenizer, [first, late], **OFF))

    async def run():
        async with Running(client, tokenizer, **FAST) as engine:
            a = engine.submit(first)[1]
            await until(lambda: client.bursts, "a first burst")
            b = engine.submit(late)[1]
            return tokens(await collect(a)), tokens(await collect(b))
    client.bursts.clear()
    got_a, got_b = asyncio.run(run())
    assert (got_a, got_b) == (tokens(want["a"]), tokens(want["b"]))


def test_a_recomputed_sequence_keeps_its_penalties(model_dir):
    """Preemption in a 12-block pool with prefix caching: r7 (28 prompt tokens) is recomputed after 5 outputs
    from a reused prefix of 32 tokens, all but its last. Its first step must be a UnifiedItem carrying
    prompt_len (a Decode item would leave outputs 0-3 out of the presence/frequency penalties)."""
    small = Recording(InProcessExecutorClient(make_executor(model_dir, kv_blocks=12, prefix_caching=True)))
    tokenizer = ModelTokenizer(model_dir)
    rng = random.Random(8)
    prompts = [(1, *(rng.randrange(3, 400) for _ in range(rng.randrange(4, 40)))) for _ in range(8)]
    penalties = SamplingParams(presence_penalty=0.7, frequency_penalty=0.9)
    reqs = [GenerateRequest(f"r{i}", p, StoppingCriteria(40, ignore_eos=True), penalties)
            for i, p in enumerate(prompts)]
    want = asyncio.run(run_all(small, tokenizer, reqs, **OFF))
    got = asyncio.run(run_all(small, tokenizer, reqs, **FAST))
    assert small.bursts and any(isinstance(e, Delta) and e.usage and e.usage.preemptions for e in got["r7"])
    assert {rid: tokens(ev) for rid, ev in got.items()} == {rid: tokens(ev) for rid, ev in want.items()}


def test_bursts_in_a_pool_too_small_for_them(model_dir):
    # 6 blocks of 16 tokens for three sequences of 10-17 prompt tokens + 30: preemption, partial bursts
    small = Recording(InProcessExecutorClient(make_executor(model_dir, kv_blocks=6, prefix_caching=False)))
    tokenizer = ModelTokenizer(model_dir)
    reqs = [GenerateRequest(f"r{i}", PROMPTS[i], StoppingCriteria(30, ignore_eos=True)) for i in range(3)]
    want = {rid: tokens(ev) for rid, ev in asyncio.run(run_all(small, tokenizer, reqs, **OFF)).items()}
    got = {rid: tokens(ev) for rid, ev in asyncio.run(run_all(small, tokenizer, reqs, **FAST)).items()}
    assert got == want and small.bursts


def test_a_refused_burst_halves_the_cap():
    b = measured(1)
    too_big = RemoteError("RESOURCE_EXHAUSTED", "the reply to this Decode could take 1.5 MiB, over this executor's "
                                                "1 MiB message limit (--max-message-mb); nothing was run")
    assert b.steps(plan_of(decoding()), False, kv(), CAPS, None) == 16
    for cap in (8, 4, 2, 1):
        assert b.refused(b.steps(plan_of(decoding()), False, kv(), CAPS, None), too_big)
        assert b.max_steps == cap and b.steps(plan_of(decoding()), False, kv(), CAPS, None) == cap
    assert not b.refused(1, too_big)  # a single step's error is the step's: it ends its requests
    fresh = measured(1)  # errors one step meets the same way are handled as a step's
    for error in (RemoteError("RESOURCE_EXHAUSTED", "KV cache full: 3 blocks needed, 1 free"),
                  RemoteError("DEADLINE_EXCEEDED", "no answer"), RemoteError("NOT_FOUND", "unknown session"),
                  RemoteError("UNAVAILABLE", "draining")):
        assert not fresh.refused(16, error) and fresh.max_steps == 16
    assert fresh.refused(16, RemoteError("INVALID_ARGUMENT", "num_steps must be <= 8")) and fresh.max_steps == 8


def test_a_refused_burst_leaves_every_sequence_as_it_was(model_dir):
    """What the engine does with a refused burst (policy.step_refused): nothing ran, so the sequences keep their
    caches and tokens and go on; one aborted while the burst was in flight releases its cache then."""
    client = InProcessExecutorClient(make_executor(model_dir, kv_blocks=64))
    policy, info = new_policy(client, max_batch_tokens=64, prefill_chunk=64)
    alone = new_policy(client, max_batch_tokens=64, prefill_chunk=64)
    want = submit(alone[0], info, GenerateRequest("w", PROMPTS[0], StoppingCriteria(8, ignore_eos=True)))
    while alone[0].has_work:
        step(alone[0], client)
    client.release_now(alone[0].releases.take())
    a, b = (submit(policy, info, GenerateRequest(r, PROMPTS[i], StoppingCriteria(8, ignore_eos=True)))
            for i, r in enumerate("ab"))
    for _ in range(2):  # prefill, one decode
        step(policy, client)
    kept = (a.cache_id, a.num_cached, list(a.output_ids))
    plan = policy.schedule()
    assert [i.seq for i in plan.items] == [a, b] and all(i.seq.is_decoding for i in plan.items)
    policy.abort(b)  # the client cancels while the burst is in flight: its cache waits for the answer
    assert policy.releases.take() == []
    policy.step_refused(plan)
    (released,) = policy.releases.take()
    assert client.release_now([released]).released == 1 and b.cache_id == ""
    assert (a.cache_id, a.num_cached, list(a.output_ids)) == kept and policy.running == [a]
    while policy.has_work:
        step(policy, client)
    assert a.output_ids == want.output_ids
    client.release_now(policy.releases.take())
    assert client.info_now().kv.active_caches == 0
