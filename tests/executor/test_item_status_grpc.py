"""Per-item statuses over gRPC, on a real executor process: a bad item of a UnifiedDecode or Decode
answers with its own status (code + message naming it), writes nothing, and the items beside it run; the
call answers OK even when every item failed; the KV pool returns to its total. Plus the reply-size refusal's
way out (bfloat16 logits) and sampling registered with the cache."""
from __future__ import annotations

import grpc
import pytest

from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_for

KV_BLOCKS = 40
MAX_LEN = 256  # the tiny checkpoint's max_position_embeddings
Code = grpc.StatusCode
UNKNOWN = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def server(request, tiny_checkpoint):
    return start_for(request, tiny_checkpoint("llama"), "--kv-blocks", str(KV_BLOCKS), "--max-message-mb", "1")


def prefill(stub, tokens: list[int]) -> tuple[str, int, int]:
    r = stub.Prefill(pb.PrefillRequest(token_ids=tokens))
    return r.cache.cache_id, r.cache.seq_len, r.output.tokens[0].token_id


def codes(response) -> list[grpc.StatusCode]:
    by_number = {c.value[0]: c for c in grpc.StatusCode}
    return [by_number[r.status.code] for r in response.results]


def release_all(stub, cache_ids) -> None:
    kv = stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[c for c in cache_ids if c])).kv
    assert (kv.free_blocks, kv.active_caches) == (KV_BLOCKS, 0), "a KV block leaked"


def test_unified_mixed_batch(stub):
    a, na, ta = prefill(stub, [5, 6, 7, 8])
    b, nb, tb = prefill(stub, [9, 10, 11])
    full, nf, tf = prefill(stub, [4] * MAX_LEN)
    item = pb.UnifiedItem
    resp = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
        item(cache_id=a, token_ids=[ta], pos_offset=na, is_final_chunk=True),  # good
        item(cache_id=UNKNOWN, token_ids=[3], pos_offset=2, is_final_chunk=True),
        item(cache_id=b, token_ids=[tb], pos_offset=nb + 1, is_final_chunk=True),  # wrong position
        item(cache_id=full, token_ids=[tf], pos_offset=nf, is_final_chunk=True),  # past max_seq_len
        item(token_ids=[3, 448], is_final_chunk=True),  # token id == vocab
        item(token_ids=[3], is_final_chunk=True, sampling=cpb.SamplingParams(temperature=1.0, top_p=0.0)),
        item(token_ids=[3], is_final_chunk=True, output=pb.OutputOptions(mode=7)),  # unknown enum value
        item(token_ids=[3], is_final_chunk=True, output=pb.OutputOptions(top_logprobs=50)),
        item(token_ids=[3], is_final_chunk=True, adapter="nope"),
        item(cache_id=a, token_ids=[3], pos_offset=na + 1, is_final_chunk=True),  # a listed twice
        item(token_ids=[12, 13, 14], is_final_chunk=True),  # good, a new cache
    ]))
    assert codes(resp) == [Code.OK, Code.NOT_FOUND, Code.FAILED_PRECONDITION, Code.OUT_OF_RANGE,
                           Code.INVALID_ARGUMENT, Code.INVALID_ARGUMENT, Code.INVALID_ARGUMENT,
                           Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.INVALID_ARGUMENT, Code.OK]
    for n, r in enumerate(resp.results):
        if r.status.code:
            assert r.status.message.startswith(f"item {n}"), r.status.message
            assert not r.HasField("output")
        else:
            assert not r.status.message and len(r.output.tokens) == 1
    assert [(r.cache.cache_id, r.cache.seq_len) for r in resp.results[1:4]] == [(UNKNOWN, 0), (b, nb), (full, nf)]
    assert resp.results[0].cache.seq_len == na + 1 and resp.results[-1].cache.seq_len == 3
    assert resp.kv.active_caches == 4  # a, b, full and the new one: no cache for a failed item
    # The good decode answered as it would alone.
    alone = stub.Prefill(pb.PrefillRequest(token_ids=[5, 6, 7, 8, ta]))
    assert alone.output.tokens[0].token_id == resp.results[0].output.tokens[0].token_id
    release_all(stub, [a, b, full, resp.results[-1].cache.cache_id, alone.cache.cache_id])


def test_decode_mixed_batch_and_all_failing(stub):
    a, na, ta = prefill(stub, [5, 6, 7, 8])
    b, nb, tb = prefill(stub, [9, 10, 11])
    resp = stub.Decode(pb.DecodeRequest(num_steps=3, items=[
        pb.DecodeItem(cache=pb.CacheRef(cache_id=a, seq_len=na), token_id=ta),
        pb.DecodeItem(cache=pb.CacheRef(cache_id=b, seq_len=nb - 1), token_id=tb),
        pb.DecodeItem(token_id=3),  # no cache id
        pb.DecodeItem(cache=pb.CacheRef(cache_id=b, seq_len=nb), token_id=tb,
                      output=pb.OutputOptions(mode=pb.OUTPUT_MODE_LOGITS)),  # cannot feed tokens back
    ]))
    assert codes(resp) == [Code.OK, Code.FAILED_PRECONDITION, Code.INVALID_ARGUMENT, Code.INVALID_ARGUMENT]
    assert len(resp.results[0].output.tokens) == 3 and resp.results[0].cache.seq_len == na + 3
    assert all(not r.output.tokens for r in resp.results[1:]) and resp.results[1].cache.seq_len == nb
    # Every item failing: the call still answers OK, with every item's status, and changes nothing.
    resp = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=pb.CacheRef(cache_id=UNKNOWN, seq_len=1)),
                                               pb.DecodeItem(cache=pb.CacheRef(cache_id=b, seq_len=0))]))
    assert codes(resp) == [Code.NOT_FOUND, Code.FAILED_PRECONDITION]
    unified = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(is_final_chunk=True)]))
    assert codes(unified) == [Code.INVALID_ARGUMENT] and unified.kv.active_caches == 2
    release_all(stub, [a, b])


def test_reply_too_large_in_float32_fits_in_bfloat16(stub):
    """The refused Decode of the error matrix (3 items x 256 steps x float32 logits, ~1.3 MiB over a 1 MiB
    limit) runs when it asks for bfloat16 logits, as the refusal's message suggests."""
    caches = [prefill(stub, [5 + i, 6, 7]) for i in range(3)]
    out = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS)
    items = [pb.DecodeItem(cache=pb.CacheRef(cache_id=c, seq_len=n), token_id=t, output=out) for c, n, t in caches]
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(items=items, num_steps=256))
    assert err.value.code() == Code.RESOURCE_EXHAUSTED and "bfloat16" in err.value.details()
    for it in items:
        it.output.logits_dtype = pb.LOGITS_DTYPE_BFLOAT16
    resp = stub.Decode(pb.DecodeRequest(items=items, num_steps=256))
    assert codes(resp) == [Code.OK] * 3
    assert all(r.output.logits.dtype == pb.LOGITS_DTYPE_BFLOAT16 for r in resp.results)
    release_all(stub, [c for c, _, _ in caches])


def test_sampling_registered_with_the_cache(stub):
    """A logit_bias sent once (on the cache's first item) keeps applying to items that send no sampling;
    sending other parameters replaces it."""
    forced = 77
    bias = cpb.SamplingParams(logit_bias={forced: 100.0})
    first = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
        pb.UnifiedItem(token_ids=[5, 6, 7], is_final_chunk=True, sampling=bias)])).results[0]
    cid, n = first.cache.cache_id, first.cache.seq_len
    assert first.output.tokens[0].token_id == forced
    for _ in range(3):  # no sampling field: the registered bias
        (r,) = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
            pb.UnifiedItem(cache_id=cid, token_ids=[forced], pos_offset=n, is_final_chunk=True)])).results
        assert r.status.code == 0 and r.output.tokens[0].token_id == forced
        n = r.cache.seq_len
    (plain,) = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(
        cache_id=cid, token_ids=[forced], pos_offset=n, is_final_chunk=True, sampling=cpb.SamplingParams())])).results
    (after,) = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(
        cache_id=cid, token_ids=[plain.output.tokens[0].token_id], pos_offset=n + 1, is_final_chunk=True)])).results
    ref = stub.Prefill(pb.PrefillRequest(token_ids=[5, 6, 7] + [forced] * 4 + [plain.output.tokens[0].token_id]))
    assert after.output.tokens[0].token_id == ref.output.tokens[0].token_id  # greedy now registered
    release_all(stub, [cid, ref.cache.cache_id])
