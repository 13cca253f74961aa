"""Frees ride with the step: UnifiedDecode and Decode release the caches their release_cache_ids
name before their items run, as ReleaseCache would (idempotent, unknown and other sessions' ids ignored),
in the same model operation; the freed blocks serve the call's own items; the caches stay released when
the call then fails; more than 4096 ids is INVALID_ARGUMENT with nothing released. In process, through the
in-process client, and through a real executor process over gRPC (capability "release_with_step"; a
request without the field behaves as before)."""
from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest

from executor_service.config import ExecutorConfig
from executor_service.executor import Executor
from executor_service.in_process_client import InProcessExecutorClient
from executor_service.request_validation import MAX_RELEASE_WITH_STEP
from executor_service.types import CacheRef, CreateCacheItem, DecodeItem, UnifiedItem
from tandem.errors import CacheNotFound, InvalidRequest, KvCapacityExceeded, RemoteError
from tandem.executor.v1 import executor_pb2 as pb
from tests.executor_driver import raising
from tests.grpc_harness import start_for

KV_BLOCKS = 8  # of 16 tokens: two 64-token prompts fill the pool
BLOCK = 16
FULL = 4 * BLOCK  # a prompt of four whole blocks


def prompt(seed: int, n: int = FULL) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


@pytest.fixture()
def ex(model_dir) -> Executor:
    return Executor(ExecutorConfig(Path(model_dir), device="cpu", kv_blocks=KV_BLOCKS, progress=False))


def fill(ex: Executor, session: str = "") -> tuple[str, str]:
    """Two caches of four full blocks each: the pool has no free block left."""
    a = ex.prefill(prompt(1), session=session).cache.cache_id
    b = ex.prefill(prompt(2), session=session).cache.cache_id
    assert ex.kv_usage().free_blocks == 0
    return a, b


def held(ex: Executor, session: str = "") -> set[str]:
    (listing,) = ex.list_caches(session) or [None]
    return {c.cache_id for c in listing.caches} if listing else set()


# ------------------------------------------------------------------------------------------ in process
def test_freed_blocks_serve_the_calls_own_items(ex):
    a, b = fill(ex)
    new = [UnifiedItem(tuple(prompt(3)))]
    with pytest.raises(KvCapacityExceeded):  # without the release the prompt does not fit
        ex.unified_decode(new)
    results = ex.unified_decode(new, release=[a])
    (r,) = raising(results)
    assert results.released == 1 and r.cache.seq_len == FULL
    assert held(ex) == {b, r.cache.cache_id}
    metrics = ex.metrics_snapshot()
    assert metrics.caches_released == 1
    assert "release_cache" not in metrics.ops  # one model operation: the release and the step under one lock


def test_decode_releases_before_its_steps(ex):
    a, b = fill(ex)
    item = DecodeItem(CacheRef(b, FULL), token_id=7)  # position 64 needs a fifth block
    with pytest.raises(KvCapacityExceeded):
        ex.decode([item], num_steps=3)
    results = ex.decode([item], num_steps=3, release=[a])
    (r,) = raising(results)
    assert results.released == 1 and r.cache.seq_len == FULL + 3 and len(r.output.tokens) == 3
    assert held(ex) == {b}


def test_unknown_and_repeated_ids_are_ignored(ex):
    a, b = fill(ex)
    item = UnifiedItem((9,), b, FULL)  # a decode into a fresh block: fits only once a is gone
    results = ex.unified_decode([item], release=[a, "no-such-cache", a, ""])
    assert results.released == 1 and results[0].error is None
    again = ex.unified_decode([UnifiedItem((9,), b, FULL + 1)], release=[a])
    assert again.released == 0 and again[0].error is None
    assert ex.unified_decode([UnifiedItem((9,), b, FULL + 2)]).released == 0  # no release: nothing counted


def test_an_item_naming_a_released_cache_fails_alone(ex):
    a, b = fill(ex)
    results = ex.unified_decode([UnifiedItem((9,), a, FULL), UnifiedItem((9,), b, FULL)], release=[a])
    assert isinstance(results[0].error, CacheNotFound) and results[1].error is None
    assert results.released == 1 and held(ex) == {b}


@pytest.mark.parametrize("failure", ["kv_full", "no_items", "too_many_tokens", "num_steps"])
def test_released_even_when_the_call_fails(ex, failure):
    a, b = fill(ex)
    free_before = ex.kv_usage().free_blocks
    if failure == "kv_full":  # 5 blocks wanted, 4 freed
        call = lambda: ex.unified_decode([UnifiedItem(tuple(prompt(4, 5 * BLOCK)))], release=[a])  # noqa: E731
        error = KvCapacityExceeded
    elif failure == "no_items":
        call, error = (lambda: ex.unified_decode([], release=[a])), InvalidRequest
    elif failure == "too_many_tokens":
        call = lambda: ex.unified_decode([UnifiedItem(tuple(prompt(4, 8193)))], release=[a])  # noqa: E731
        error = InvalidRequest
    else:
        call = lambda: ex.decode([DecodeItem(CacheRef(b, FULL), 7)], num_steps=257, release=[a])  # noqa: E731
        error = InvalidRequest
    with pytest.raises(error):
        call()
    assert held(ex) == {b} and ex.kv_usage().free_blocks == free_before + 4
    assert ex.cache_length(b) == FULL  # the failed call wrote nothing of its items


@pytest.mark.parametrize("step", ["unified", "decode"])
def test_over_the_limit_is_refused_with_nothing_released(ex, step):
    a, b = fill(ex)
    ids = [a] + [f"x{n}" for n in range(MAX_RELEASE_WITH_STEP)]
    with pytest.raises(InvalidRequest, match="4096") as err:
        if step == "unified":
            ex.unified_decode([UnifiedItem((9,), b, FULL)], release=ids)
        else:
            ex.decode([DecodeItem(CacheRef(b, FULL), 9)], release=ids)
    assert "ReleaseCache" in str(err.value)  # what to do instead
    assert held(ex) == {a, b} and ex.cache_length(b) == FULL
    results = ex.unified_decode([UnifiedItem((9,), b, FULL)], release=ids[:MAX_RELEASE_WITH_STEP])  # 4096: fine
    assert results.released == 1


def test_another_sessions_cache_is_not_released(ex):
    other = ex.open_session("other").session_id
    theirs = ex.prefill(prompt(1, FULL - 4), session=other).cache.cache_id
    mine = ex.prefill(prompt(2, FULL - 4)).cache.cache_id
    results = ex.unified_decode([UnifiedItem((9,), mine, FULL - 4)], release=[theirs])
    assert results.released == 0 and results[0].error is None and held(ex, other) == {theirs}
    results = ex.unified_decode([UnifiedItem((9,), theirs, FULL - 4)], session=other, release=[mine])
    assert results.released == 0 and results[0].error is None and mine in held(ex)


def test_released_blocks_stay_in_the_prefix_cache_as_with_release_cache(ex):
    """The same release as release_cache: its full blocks stay indexed, so the same prompt reuses them."""
    a = ex.prefill(prompt(1)).cache.cache_id
    b = ex.prefill(prompt(2, FULL - 4)).cache.cache_id  # its next token fits in its last block
    ex.unified_decode([UnifiedItem((9,), b, FULL - 4)], release=[a])
    assert ex.kv_usage().cached_blocks == 4  # a's four: free, and still indexed
    (created,) = ex.create_caches([CreateCacheItem(tuple(prompt(1)))])
    assert created.cached_tokens == FULL - 1  # every block (the last one short of its last token, to compute)


# ----------------------------------------------------------------------------------- in-process client
def test_in_process_client_passes_release_through(ex):
    client = InProcessExecutorClient(ex)
    a, b = fill(ex)
    resp = client.unified_decode_now([pb.UnifiedItem(cache_id=b, token_ids=[9], pos_offset=FULL,
                                                     is_final_chunk=True)], release=[a])
    assert resp.released == 1 and resp.results[0].status.code == 0 and held(ex) == {b}
    resp = client.decode_now([pb.DecodeItem(cache=pb.CacheRef(cache_id=b, seq_len=FULL + 1), token_id=9)], 1,
                             release=[b, "gone"])
    assert resp.released == 1 and resp.results[0].status.code != 0 and held(ex) == set()
    with pytest.raises(RemoteError) as err:
        client.unified_decode_now([pb.UnifiedItem(token_ids=[9], is_final_chunk=True)],
                                  release=["x"] * (MAX_RELEASE_WITH_STEP + 1))
    assert err.value.status_name == "INVALID_ARGUMENT"


def test_release_happens_when_no_item_converts(ex):
    """Every item fails its own conversion (a bad enum): the executor's step is not called, the release is."""
    client = InProcessExecutorClient(ex)
    a, b = fill(ex)
    bad = pb.UnifiedItem(cache_id=b, token_ids=[9], pos_offset=FULL, is_final_chunk=True,
                         output=pb.OutputOptions(mode=99))
    resp = client.unified_decode_now([bad], release=[a])
    assert resp.released == 1 and resp.results[0].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "output.mode" in resp.results[0].status.message
    assert held(ex) == {b}
    resp = client.unified_decode_now([bad])  # no release: as before, no executor call at all
    assert resp.released == 0 and held(ex) == {b}


# ------------------------------------------------------------------------------------------------ gRPC
@pytest.fixture(scope="module")
def server(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", str(KV_BLOCKS))


def grpc_fill(stub, session: str, seed: int) -> tuple[str, str]:
    """Two caches of four full blocks each (prompts no other test uses): the pool is full."""
    a = stub.Prefill(pb.PrefillRequest(token_ids=prompt(seed), session_id=session)).cache.cache_id
    resp = stub.Prefill(pb.PrefillRequest(token_ids=prompt(seed + 1), session_id=session))
    assert resp.kv.free_blocks == 0
    return a, resp.cache.cache_id


def listed(stub, session: str) -> set[str]:
    (s,) = stub.ListCaches(pb.ListCachesRequest(session_id=session)).sessions
    return {c.cache_id for c in s.caches}


@pytest.fixture()
def session(stub):
    sid = stub.OpenSession(pb.OpenSessionRequest(client_name="release-with-step")).session_id
    yield sid
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_capability_is_listed(stub):
    assert "release_with_step" in stub.GetInfo(pb.GetInfoRequest()).capabilities


def test_unified_decode_releases_over_grpc(stub, session):
    a, b = grpc_fill(stub, session, 10)
    resp = stub.UnifiedDecode(pb.UnifiedDecodeRequest(
        items=[pb.UnifiedItem(token_ids=prompt(3), is_final_chunk=True)], session_id=session,
        release_cache_ids=[a, "unknown"]))
    assert resp.released == 1 and resp.results[0].status.code == 0
    new = resp.results[0].cache.cache_id
    assert listed(stub, session) == {b, new} and resp.kv.free_blocks == 0


def test_decode_releases_over_grpc(stub, session):
    a, b = grpc_fill(stub, session, 20)
    resp = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=pb.CacheRef(cache_id=b, seq_len=FULL),
                                                             token_id=9)],
                                        num_steps=2, session_id=session, release_cache_ids=[a]))
    assert resp.released == 1 and resp.results[0].cache.seq_len == FULL + 2
    assert listed(stub, session) == {b} and resp.kv.free_blocks == KV_BLOCKS - 5


def test_released_when_the_call_fails_over_grpc(stub, session):
    a, b = grpc_fill(stub, session, 30)
    with pytest.raises(grpc.RpcError) as err:  # five blocks wanted, four freed
        stub.UnifiedDecode(pb.UnifiedDecodeRequest(
            items=[pb.UnifiedItem(token_ids=prompt(4, 5 * BLOCK), is_final_chunk=True)], session_id=session,
            release_cache_ids=[a]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert listed(stub, session) == {b}


def test_over_the_limit_is_invalid_argument_over_grpc(stub, session):
    a, b = grpc_fill(stub, session, 40)
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=pb.CacheRef(cache_id=b, seq_len=FULL), token_id=9)],
                                     session_id=session, release_cache_ids=[a] * (MAX_RELEASE_WITH_STEP + 1)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4096" in err.value.details()
    assert listed(stub, session) == {a, b}


def test_a_request_without_the_field_behaves_as_before(stub, session):
    """An older client's request (no field 3 on the wire): nothing released, released 0, the step as always."""
    a, b = grpc_fill(stub, session, 50)
    wire = pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(cache_id=b, token_ids=[9], pos_offset=FULL,
                                                         is_final_chunk=True)], session_id=session)
    with pytest.raises(grpc.RpcError) as err:  # the pool is full: the decode needs a fifth block
        stub.UnifiedDecode(wire)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and listed(stub, session) == {a, b}
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[a], session_id=session))
    resp = stub.UnifiedDecode(wire)
    assert resp.released == 0 and resp.results[0].status.code == 0 and listed(stub, session) == {b}
