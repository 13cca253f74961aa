"""Prefix caching through the whole stack (real executor and scheduler processes, tiny llama): requests sharing
a system prompt, and a multi-turn chat, reuse the executor's cached blocks (usage.cached_tokens, GetMetrics)
and stream exactly what an executor with --no-prefix-caching gives; preempted requests under a small pool get
their prefix back and lose nothing; every block is free (or cached, evictable) once all requests end."""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect, ids_request, wait_kv_free

BLOCK = 16
SYSTEM = [1] + [3 + (i * 37) % 397 for i in range(95)]  # 96 tokens: 6 full blocks
STOP = pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def on(request, model_dir):
    executor = start_for(request, model_dir, "--kv-blocks", "256")
    return executor, start_scheduler_for(request, executor.address)


@pytest.fixture(scope="module")
def off(request, model_dir):
    executor = start_for(request, model_dir, "--kv-blocks", "256", "--no-prefix-caching")
    return executor, start_scheduler_for(request, executor.address)


def _questions(n: int) -> list[list[int]]:
    return [SYSTEM + [200 + q, 17, 300 + 3 * q] for q in range(n)]


def test_a_shared_system_prompt_is_computed_once(on, off):
    (ex_on, sch_on), (ex_off, sch_off) = on, off
    before = ex_on.stub.GetMetrics(epb.GetMetricsRequest()).prefix_cache
    first = collect(sch_on.stub, ids_request(_questions(1)[0], 0, stopping=STOP))
    assert first.usage.cached_tokens == 0
    with cf.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: collect(sch_on.stub, ids_request(p, 0, stopping=STOP)), _questions(7)[1:]))
        want = list(pool.map(lambda p: collect(sch_off.stub, ids_request(p, 0, stopping=STOP)), _questions(7)[1:]))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(g.usage.cached_tokens == len(SYSTEM) for g in got), [(g.usage.cached_tokens, g.usage.preemptions) for g in got]  # 6 whole blocks each
    assert all(w.usage.cached_tokens == 0 for w in want)
    after = ex_on.stub.GetMetrics(epb.GetMetricsRequest()).prefix_cache
    assert after.enabled and after.hit_tokens - before.hit_tokens == 6 * len(SYSTEM)
    assert not ex_off.stub.GetMetrics(epb.GetMetricsRequest()).prefix_cache.enabled
    kv = wait_kv_free(ex_on.stub)
    assert kv.cached_blocks > 0  # free, but still holding the prefixes for the next requests


def test_multi_turn_chat_reuses_every_earlier_turn(on, off):
    (ex_on, sch_on), (_, sch_off) = on, off
    convo_on, convo_off = list(SYSTEM[:40]), list(SYSTEM[:40])
    hits = []
    for turn in range(4):
        user = [250 + turn, 11, 12, 13, 260 + turn]
        convo_on += user
        convo_off += user
        a = collect(sch_on.stub, ids_request(convo_on, 0, stopping=STOP))
        b = collect(sch_off.stub, ids_request(convo_off, 0, stopping=STOP))
        assert a.token_ids == b.token_ids
        hits.append(a.usage.cached_tokens)
        convo_on += a.token_ids
        convo_off += b.token_ids
    assert all(h % BLOCK == 0 for h in hits)
    assert hits[1:] == sorted(hits[1:]) and hits[-1] > hits[1] > 0  # each turn reuses the conversation so far
    wait_kv_free(ex_on.stub)


def test_preempted_requests_get_their_prefix_back_and_lose_nothing(request, model_dir, off):
    executor = start_for(request, model_dir, "--kv-blocks", "14")  # 224 tokens for everyone
    scheduler = start_scheduler_for(request, executor.address, "--speculative", "off")  # (preemption, not drafts)
    _, sch_off = off
    stop = pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True)
    prompts = [SYSTEM[:48] + [210 + q, 5, 6] for q in range(6)]  # 3 shared blocks + 51..91 tokens each
    with cf.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: collect(scheduler.stub, ids_request(p, 0, stopping=stop)), prompts))
    want = [collect(sch_off.stub, ids_request(p, 0, stopping=stop)) for p in prompts]
    assert sum(g.usage.preemptions for g in got) > 0, "the pool was meant to be too small for all at once"
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert executor.stub.GetMetrics(epb.GetMetricsRequest()).prefix_cache.hit_tokens > 0
    wait_kv_free(executor.stub)
