"""The scheduling policy and the engine with an executor that reuses cached prefixes (in process, tiny
model): which waiting requests are looked up, what admission counts, what happens to reused prefixes held by
requests that are not admitted, that end, or whose executor is lost."""
from __future__ import annotations

import asyncio

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler.config import SchedulerConfig
from scheduler.engine.engine import Engine
from scheduler.engine.policy import SchedulingPolicy
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence
from tandem.codec import kv_usage_from_pb
from tandem.executor.v1 import executor_pb2 as epb
from tests.executor_driver import make_executor
from scheduler.engine.executor_codec import executor_info_from_pb

SYSTEM = [1] + [5 + (i * 7) % 300 for i in range(63)]  # 64 tokens: 4 blocks of 16


def _request(n: int, suffix: list[int], max_new: int = 6) -> GenerateRequest:
    return GenerateRequest(f"r{n}", tuple(SYSTEM + suffix), StoppingCriteria(max_new, ignore_eos=True))


@pytest.fixture
def client(model_dir):
    return InProcessExecutorClient(make_executor(model_dir, kv_blocks=64))


def _run(engine: Engine, reqs: list[GenerateRequest]) -> list:
    async def go():
        await engine.start()
        outs = [engine.submit(r)[1] for r in reqs]
        task = asyncio.create_task(engine.run())
        results = []
        for out in outs:
            ids, usage = [], None
            while True:
                ev = await asyncio.wait_for(out.events.get(), 60)
                assert not isinstance(ev, Exception), ev
                ids += [t.token_id for t in ev.tokens]
                if ev.finish_reason is not None:
                    usage = ev.usage
                    break
            results.append((ids, usage))
        await engine.drain(1.0)
        await task
        return results
    return asyncio.run(go())


def test_requests_after_the_first_reuse_the_shared_prefix_and_match_a_run_without_it(model_dir, client, tok):
    info = client.info_now()
    assert "prefix_caching" in info.capabilities
    reqs = [_request(n, [400 + n, 401 + n, 402]) for n in range(4)]
    first = _run(Engine(SchedulerConfig(executor="in-process", max_running=1), client, tok, executor_info_from_pb(info)), reqs)
    off = InProcessExecutorClient(make_executor(model_dir, kv_blocks=64, prefix_caching=False))
    plain = _run(Engine(SchedulerConfig(executor="in-process", max_running=1), off, tok, executor_info_from_pb(off.info_now())), reqs)
    assert [ids for ids, _ in first] == [ids for ids, _ in plain]
    assert first[0][1].cached_tokens == 0 and all(u.cached_tokens == 64 for _, u in first[1:])
    assert all(u.cached_tokens == 0 for _, u in plain)
    kv = client.info_now().kv
    assert kv.free_blocks == kv.total_blocks and kv.cached_blocks > 0 and kv.active_caches == 0


def test_policy_looks_up_free_slots_only_and_releases_what_ends(client, tok):
    info = client.info_now()
    policy = SchedulingPolicy(SchedulerConfig(executor="in-process", max_running=2), kv_usage_from_pb(info.kv), info.max_batch_tokens)
    seqs = [Sequence(_request(n, [300 + n]), policy.next_arrival(), [], 2048) for n in range(3)]
    for s in seqs:
        policy.add(s)
    picked = policy.to_match()
    assert picked == seqs[:2]  # two running slots: the third is not looked up yet
    resp = client.create_caches_now([epb.CreateCacheItem(token_ids=s.token_slice(0, s.num_tokens)) for s in picked])
    seqs[1].status = seqs[1].status.FINISHED  # ended (cancelled) while CreateCache ran
    policy.waiting.remove(seqs[1])
    policy.attach_prefixes(picked, [(r.cache.cache_id, r.cache.seq_len) for r in resp.results])
    assert seqs[0].cache_id and not seqs[1].cache_id
    released = policy.releases.take()
    assert released == [resp.results[1].cache.cache_id]  # the ended request's new cache goes back at once
    assert policy.to_match() == [seqs[2]]
    # The executor is lost: the reused prefix held by the waiting request is stale, the request starts over.
    policy.executor_lost()
    assert not seqs[0].cache_id and seqs[0].num_cached == 0 and seqs[0].preemptions == 0
    assert resp.results[0].cache.cache_id in policy.releases.take_stale()


def test_no_prefix_is_reused_while_the_running_requests_are_short_of_blocks(client, tok):
    """Pinning a preempted request's prefix right after its release would take back the blocks the
    running requests were given (the livelock this guards against: preempt, re-pin, re-admit, repeat)."""
    info = client.info_now()
    policy = SchedulingPolicy(SchedulerConfig(executor="in-process"), kv_usage_from_pb(info.kv), info.max_batch_tokens)
    waiting = Sequence(_request(0, [300]), policy.next_arrival(), [], 2048)
    policy.add(waiting)
    waiting.adopt_prefix("held", 48)
    policy.short_of_blocks = False
    decoder = Sequence(_request(1, []), policy.next_arrival(), [], 2048)  # 64 + 1 output: a new block next
    decoder.cache_id, decoder.num_cached, decoder.output_ids = "run", 64, [7]
    decoder.status = decoder.status.RUNNING
    policy.running.append(decoder)
    policy.kv = kv_usage_from_pb(epb.KvUsage(block_size=16, total_blocks=8, free_blocks=0))
    plan = policy.schedule()
    assert plan.unpinned == [waiting] and not plan.items
    assert policy.releases.take() == ["held"] and not waiting.cache_id and waiting.num_cached == 0
    assert policy.short_of_blocks and policy.to_match() == []  # not looked up again at once
    policy.kv = kv_usage_from_pb(epb.KvUsage(block_size=16, total_blocks=8, free_blocks=1))
    plan = policy.schedule()  # the decode fits now: the plan runs it and lookups resume
    assert [i.seq for i in plan.items] == [decoder] and not policy.short_of_blocks
    assert policy.to_match() == [waiting]


def test_a_burst_sharing_a_prompt_computes_it_once_and_matches_a_run_without_it(model_dir, client, tok):
    """Eight requests arrive together: the first writes the shared prompt, the others wait for it to be
    written and reuse it (rather than all computing it side by side)."""
    reqs = [_request(n, [410 + n, 5, 6]) for n in range(8)]
    cfg = SchedulerConfig(executor="in-process", max_running=8, prefill_chunk=16)
    burst = _run(Engine(cfg, client, tok, executor_info_from_pb(client.info_now())), reqs)
    off = InProcessExecutorClient(make_executor(model_dir, kv_blocks=64, prefix_caching=False))
    plain = _run(Engine(cfg, off, tok, executor_info_from_pb(off.info_now())), reqs)
    assert [ids for ids, _ in burst] == [ids for ids, _ in plain]
    assert burst[0][1].cached_tokens == 0 and all(u.cached_tokens == len(SYSTEM) for _, u in burst[1:])
    assert client.executor.prefix_stats().hit_tokens == 7 * len(SYSTEM)
    kv = client.info_now().kv
    assert kv.free_blocks == kv.total_blocks and kv.active_caches == 0
