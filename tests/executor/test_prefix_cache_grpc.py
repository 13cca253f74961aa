"""Prefix caching through the real executor process: CreateCache then the rest of the prompt by Prefill or
UnifiedDecode, per-item statuses, the metrics, clients racing for one prefix, and the SubscribeKvEvents
stream (snapshot, stored and removed events whose hashes a router computes from the prompt, summaries)."""
from __future__ import annotations

import random
import threading

import grpc
import numpy as np
import pytest

from executor_service.rpc import codec
from tandem.block_hash import chain_hashes, root_hash
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc
from tests.grpc_harness import start_for
from tests.kv_event_reader import KvEventReader, removed_hashes, stored

KV_BLOCKS = 32
BS = 16
WITH_LOGITS = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS)
TOL = dict(rtol=1e-5, atol=1e-5)  # the same numbers reached another way: float32 summation order


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


@pytest.fixture(scope="module")
def server(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", str(KV_BLOCKS))


@pytest.fixture(autouse=True)
def no_leaks(stub):
    yield
    kv = stub.GetInfo(pb.GetInfoRequest()).kv
    assert (kv.free_blocks, kv.active_caches) == (KV_BLOCKS, 0), kv
    assert kv.cached_blocks <= kv.free_blocks


def release(stub, *cache_ids: str) -> pb.ReleaseCacheResponse:
    return stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=list(cache_ids)))


def warm(stub, prompt: list[int]) -> pb.PrefillResponse:
    """Prefills a prompt whole and releases it: its full blocks stay cached."""
    res = stub.Prefill(pb.PrefillRequest(token_ids=prompt, output=WITH_LOGITS))
    assert res.cached_tokens == 0
    release(stub, res.cache.cache_id)
    return res


def test_create_cache_then_send_the_rest(stub):
    p = prompt_of(40, seed=1)
    whole = warm(stub, p)
    cached_before = stub.GetInfo(pb.GetInfoRequest()).kv.cached_blocks
    resp = stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=p)] * 2))
    assert [(r.status.code, r.cached_tokens, r.cache.seq_len) for r in resp.results] == [(0, 32, 32)] * 2
    a, b = (r.cache.cache_id for r in resp.results)
    assert a != b and len(a) == 32
    assert (resp.kv.active_caches, resp.kv.cached_blocks) == (2, cached_before - 2)  # both hold the 2 blocks
    rest = stub.Prefill(pb.PrefillRequest(cache_id=a, token_ids=p[32:], output=WITH_LOGITS))
    assert rest.cached_tokens == 32 and rest.cache.seq_len == 40
    (unified,) = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(
        cache_id=b, token_ids=p[32:], pos_offset=32, is_final_chunk=True, output=WITH_LOGITS)])).results
    assert unified.status.code == 0 and unified.cache.seq_len == 40
    for out in (rest.output, unified.output):
        assert out.tokens[0].token_id == whole.output.tokens[0].token_id
        np.testing.assert_allclose(codec.decode_logits(out.logits), codec.decode_logits(whole.output.logits), **TOL)
    assert release(stub, a, b).released == 2


def test_create_cache_statuses(stub):
    p = prompt_of(20, seed=2)
    resp = stub.CreateCache(pb.CreateCacheRequest(items=[
        pb.CreateCacheItem(token_ids=p), pb.CreateCacheItem(token_ids=[5, 448]),
        pb.CreateCacheItem(token_ids=p, adapter="nope"), pb.CreateCacheItem(token_ids=p, cache_salt="s" * 257),
        pb.CreateCacheItem(token_ids=prompt_of(257, seed=3)), pb.CreateCacheItem(token_ids=p, cache_salt="t")]))
    codes = [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
             grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.OK]
    assert [r.status.code for r in resp.results] == [c.value[0] for c in codes]
    for n, r in enumerate(resp.results):
        if r.status.code:
            assert r.status.message.startswith(f"item {n}: ") and r.cache.cache_id == ""
    assert "'nope'" in resp.results[2].status.message and "LoadAdapter" in resp.results[2].status.message
    ok = [r.cache.cache_id for r in resp.results if r.status.code == 0]
    assert resp.kv.active_caches == 2
    for items in ([], [pb.CreateCacheItem(token_ids=p)] * 257):
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateCache(pb.CreateCacheRequest(items=items))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1 to 256 items" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=p)], session_id="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.GetInfo(pb.GetInfoRequest()).kv.active_caches == 2  # the refused calls created nothing
    assert release(stub, *ok).released == 2


def test_metrics_and_usage(stub):
    info = stub.GetInfo(pb.GetInfoRequest())
    assert {"create_cache", "kv_events", "prefix_caching"} <= set(info.capabilities)
    p = prompt_of(50, seed=4)
    warm(stub, p)
    before = stub.GetMetrics(pb.GetMetricsRequest())
    assert before.prefix_cache.enabled and before.prefix_cache.indexed_blocks >= 3
    resp = stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=p),
                                                         pb.CreateCacheItem(token_ids=p[:20])]))
    after = stub.GetMetrics(pb.GetMetricsRequest())
    assert after.prefix_cache.query_tokens - before.prefix_cache.query_tokens == 70
    assert after.prefix_cache.hit_tokens - before.prefix_cache.hit_tokens == 48 + 16
    # p's 3 blocks left the cached-evictable ones (block 0 held twice); free counts only unheld blocks.
    assert after.kv.cached_blocks == resp.kv.cached_blocks == before.kv.cached_blocks - 3
    assert after.kv.free_blocks == before.kv.free_blocks - 3
    release(stub, *(r.cache.cache_id for r in resp.results))
    kv = stub.GetInfo(pb.GetInfoRequest()).kv
    assert kv.cached_blocks == stub.GetMetrics(pb.GetMetricsRequest()).prefix_cache.indexed_blocks


def test_clients_racing_for_one_prefix(server, stub):
    """Four clients (own channels) create, prefill and decode the same prompt at once: identical outputs, the
    prompt's blocks indexed once, nothing leaked."""
    p = prompt_of(40, seed=5)
    before = stub.GetMetrics(pb.GetMetricsRequest()).prefix_cache
    start = threading.Barrier(4)
    outputs: list = [None] * 4

    def client(n: int) -> None:
        with grpc.insecure_channel(server.address) as channel:
            s = pb_grpc.ExecutorServiceStub(channel)
            start.wait(timeout=30)
            (r,) = s.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=p)])).results
            cid, cached = r.cache.cache_id, r.cached_tokens
            res = s.Prefill(pb.PrefillRequest(cache_id=cid, token_ids=p[cached:], output=WITH_LOGITS))
            (d,) = s.Decode(pb.DecodeRequest(items=[pb.DecodeItem(
                cache=pb.CacheRef(cache_id=cid, seq_len=40), token_id=res.output.tokens[0].token_id,
                output=WITH_LOGITS)], num_steps=4)).results
            release(s, cid)
            outputs[n] = (cached, [res.output.tokens[0].token_id] + [t.token_id for t in d.output.tokens],
                          codec.decode_logits(d.output.logits))

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(o is not None for o in outputs), "a client failed (see the thread's exception above)"
    assert {o[0] for o in outputs} <= {0, 32}
    for cached, tokens, logits in outputs[1:]:
        assert tokens == outputs[0][1]
        np.testing.assert_allclose(logits, outputs[0][2], **TOL)
    after = stub.GetMetrics(pb.GetMetricsRequest()).prefix_cache
    # The cache held 40 + 4 tokens: 2 full blocks, stored once whoever computed them.
    assert after.stored_blocks - before.stored_blocks == 2
    assert after.indexed_blocks - before.indexed_blocks == 2 - (after.evicted_blocks - before.evicted_blocks)


# ----------------------------------------------------------------------------- SubscribeKvEvents
def test_kv_events(stub):
    """Snapshot first, then a summary, stored events with the hashes computed from the prompt, removed events
    on eviction, periodic summaries."""
    p1 = prompt_of(40, seed=10)
    warm(stub, p1)
    base = root_hash()
    instance = stub.GetInfo(pb.GetInfoRequest()).instance_id
    reader = KvEventReader(stub, summary_interval_ms=100)
    try:
        first = reader.until(lambda m: not m.snapshot, what="the first message after the snapshot")
        snapshot = [h for m in first[:-1] for e in m.events for h in e.stored.block_hashes]
        assert all(m.snapshot for m in first[:-1]) and set(chain_hashes(base, p1, BS)) <= set(snapshot)
        assert [m.seq for m in first] == list(range(1, len(first) + 1))
        summary = first[-1]
        assert summary.HasField("summary") and summary.instance_id == instance and not summary.events
        assert summary.summary.kv.total_blocks == KV_BLOCKS and summary.summary.prefix_cache.enabled
        assert summary.summary.prefix_cache.indexed_blocks == len(snapshot)

        # A new prompt's full blocks: one stored event, hashes chained from the root as a router computes them.
        p2 = prompt_of(50, seed=11)
        warm(stub, p2)
        want = chain_hashes(base, p2, BS)
        got = stored(reader.until(lambda m: any(e.stored.block_hashes[:1] == want[:1] for e in m.events),
                                  what="the stored event of p2"))
        event = next(e for e in got if e.block_hashes[:1] == want[:1])
        assert (list(event.block_hashes), event.parent_hash, event.adapter, event.token_count) == (want, b"", "", 48)

        # A salted prompt that extends a cached one: only the new blocks, chained from the last reused one.
        salted = root_hash("", "", "tenant")
        resp = stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=p2[:33], cache_salt="tenant")]))
        (r,) = resp.results
        assert r.cached_tokens == 0
        stub.Prefill(pb.PrefillRequest(cache_id=r.cache.cache_id, token_ids=p2[:33]))
        (r2,) = stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=p2, cache_salt="tenant")])).results
        assert r2.cached_tokens == 32
        stub.Prefill(pb.PrefillRequest(cache_id=r2.cache.cache_id, token_ids=p2[32:]))
        release(stub, r.cache.cache_id, r2.cache.cache_id)
        want_salted = chain_hashes(salted, p2, BS)
        got = stored(reader.until(lambda m: any(want_salted[2] in e.stored.block_hashes for e in m.events),
                                  what="the stored event of the salted prompt's third block"))
        event = next(e for e in got if want_salted[2] in e.block_hashes)
        assert (list(event.block_hashes), event.parent_hash, event.token_count) == ([want_salted[2]], want_salted[1], 16)

        # Fill the pool with other prompts: cached blocks are evicted, each announced once.
        known = set(snapshot) | set(want) | set(want_salted[:3])
        evicted0 = stub.GetMetrics(pb.GetMetricsRequest()).prefix_cache.evicted_blocks
        fillers = [prompt_of(96, seed=20 + i) for i in range(6)]
        for f in fillers:
            warm(stub, f)
            known |= set(chain_hashes(base, f, BS))
        evicted = stub.GetMetrics(pb.GetMetricsRequest()).prefix_cache.evicted_blocks - evicted0
        assert evicted > 0
        gone: list[bytes] = []
        while len(gone) < evicted:
            gone += removed_hashes(reader.until(lambda m: bool(removed_hashes([m])), what="removed events"))
        assert len(gone) == len(set(gone)) == evicted and set(gone) <= known
        assert set(chain_hashes(base, p1, BS)) <= set(gone)  # p1's blocks were the least recently used

        # Summaries keep coming every 100 ms on a quiet stream, with the pool as it is.
        kv = stub.GetInfo(pb.GetInfoRequest()).kv
        reader.until(lambda m: m.HasField("summary") and not m.events and m.summary.kv == kv,
                     what="a periodic summary of the pool as it is now")
    finally:
        reader.close()


def test_summary_interval_below_100ms_is_invalid(stub):
    reader = KvEventReader(stub, summary_interval_ms=99)
    try:
        with pytest.raises(grpc.RpcError) as err:
            reader.next()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "100" in err.value.details()
    finally:
        reader.close()
