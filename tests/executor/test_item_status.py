"""Per-item results in process: in Decode and UnifiedDecode an item that is wrong on its own gets
its own error and writes nothing; the others run and answer exactly as they would alone. Errors of the call
(no items, too many tokens, KV full) still raise with nothing written. The in-process client answers with
the same per-item statuses as the gRPC server. On each device (tests/devices.py), pools and failed writes there
included: "as alone" is the same token in float32, up to a near tie of the alone run's logits in bfloat16
(tests/device_tolerances.py: another batch, another rounding)."""
from __future__ import annotations

import grpc
import pytest

from executor_service.in_process_client import InProcessExecutorClient
from executor_service.types import CacheRef, DecodeItem, OutputMode, OutputOptions, UnifiedItem
from tandem.common.v1 import common_pb2 as cpb
from tandem.errors import (CacheNotFound, InvalidRequest, KvCapacityExceeded, PositionMismatch, RemoteError,
                           SequenceTooLong)
from tandem.executor.v1 import executor_pb2 as pb
from tandem.sampling_params import SamplingParams
from tests.device_tolerances import assert_greedy_token, greedy_agreement
from tests.executor_driver import LOGITS, make_executor

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture()
def ex(model_dir, device):
    return make_executor(model_dir, kv_blocks=40, device=device)


def lengths(ex, *cids: str) -> list[int]:
    return [ex.cache_length(c) for c in cids]


def test_unified_bad_items_fail_alone_good_items_answer_as_alone(ex, model_dir, device):
    max_len = ex.info().max_seq_len
    a = ex.prefill(PROMPT)
    b = ex.prefill(PROMPT[:3])
    long = ex.prefill([4] * (max_len - 1))
    ids = a.cache.cache_id, b.cache.cache_id, long.cache.cache_id
    free, tok = ex.kv_usage().free_blocks, a.output.tokens[0].token_id
    results = ex.unified_decode([
        UnifiedItem((tok,), ids[0], 5),  # good decode
        UnifiedItem((3,), "f" * 32, 3),  # unknown cache
        UnifiedItem((3,), ids[1], 7),  # wrong position
        UnifiedItem((3, 4), ids[2], max_len - 1),  # past the model's length
        UnifiedItem(tuple(PROMPT[::-1])),  # good new cache
        UnifiedItem((3,), ids[0], 6),  # the same cache again: the second occurrence fails
        UnifiedItem((3,), sampling=SamplingParams(top_p=2.0)),  # bad sampling value
    ])
    kinds = [type(r.error) if r.error else None for r in results]
    assert kinds == [None, CacheNotFound, PositionMismatch, SequenceTooLong, None, InvalidRequest, InvalidRequest]
    for n, r in enumerate(results):
        if r.error:
            assert str(r.error).startswith(f"item {n}"), r.error  # the message names the item
            assert r.output is None
    assert "appears twice" in str(results[5].error) and "top_p" in str(results[6].error)
    # Failed items report their cache as it is (unknown: length 0) and wrote nothing.
    assert [r.cache for r in results[1:4]] == [CacheRef("f" * 32, 0), CacheRef(ids[1], 3),
                                               CacheRef(ids[2], max_len - 1)]
    assert lengths(ex, *ids) == [6, 3, max_len - 1] and ex.kv_usage().active_caches == 4
    assert ex.kv_usage().free_blocks == free - 1  # only the new cache's block
    # The good items answer as they would alone.
    alone = make_executor(model_dir, kv_blocks=40, device=device)
    want_a = alone.prefill(PROMPT + [tok], output=LOGITS).output.logits[0]
    want_new = alone.prefill(PROMPT[::-1], output=LOGITS).output.logits[0]
    assert_greedy_token(results[0].output.tokens[0].token_id, want_a, device.dtype, "the good decode")
    assert_greedy_token(results[4].output.tokens[0].token_id, want_new, device.dtype, "the good new cache")


def test_every_item_failing_still_answers(ex):
    a = ex.prefill(PROMPT)
    results = ex.unified_decode([UnifiedItem((3,), a.cache.cache_id, 2), UnifiedItem((), None, 0)])
    assert [type(r.error) for r in results] == [PositionMismatch, InvalidRequest]
    assert ex.cache_length(a.cache.cache_id) == 5 and ex.kv_usage().active_caches == 1


def test_call_errors_still_raise_with_nothing_written(model_dir):
    ex = make_executor(model_dir, kv_blocks=4, max_batch_tokens=64)
    a = ex.prefill([3] * 40)  # 3 of the 4 blocks (16 tokens each)
    with pytest.raises(InvalidRequest, match="no items"):
        ex.unified_decode([])
    with pytest.raises(InvalidRequest, match="max-batch-tokens"):  # the call's total, bad items included
        ex.unified_decode([UnifiedItem((3,) * 40), UnifiedItem((10**6,) * 30)])
    with pytest.raises(KvCapacityExceeded):  # the KV pool is the call's: all or nothing
        ex.unified_decode([UnifiedItem((4,), a.cache.cache_id, 40), UnifiedItem((3,) * 20),
                           UnifiedItem((3,), "f" * 32, 0)])
    assert ex.cache_length(a.cache.cache_id) == 40 and ex.kv_usage().free_blocks == 1
    assert ex.kv_usage().active_caches == 1


def test_decode_items_fail_alone(ex, model_dir, device):
    a, b = ex.prefill(PROMPT), ex.prefill(PROMPT[:4])
    ta, tb = a.output.tokens[0].token_id, b.output.tokens[0].token_id
    logits_only = OutputOptions(OutputMode.LOGITS)
    results = ex.decode([
        DecodeItem(CacheRef(a.cache.cache_id, 5), ta, output=LOGITS),
        DecodeItem(CacheRef(b.cache.cache_id, 9), tb),  # wrong position
        DecodeItem(CacheRef(b.cache.cache_id, 4), tb, output=logits_only),  # logits only cannot feed back
        DecodeItem(CacheRef("f" * 32, 1), 3),
        DecodeItem(CacheRef(a.cache.cache_id, 5), ta),  # the same cache again
    ], num_steps=4)
    assert [type(r.error) if r.error else None for r in results] == [None, PositionMismatch, InvalidRequest,
                                                                     CacheNotFound, InvalidRequest]
    assert "output mode must include tokens" in str(results[2].error)
    assert all(not r.output.tokens for r in results[1:])
    assert lengths(ex, a.cache.cache_id, b.cache.cache_id) == [9, 4]
    alone = make_executor(model_dir, kv_blocks=40, device=device)
    r = alone.prefill(PROMPT)
    assert r.output.tokens[0].token_id == ta  # (the same history, the same executor's arithmetic)
    (want,) = alone.decode([DecodeItem(CacheRef(r.cache.cache_id, 5), ta, output=LOGITS)], num_steps=4)
    greedy_agreement([t.token_id for t in results[0].output.tokens], list(results[0].output.logits),
                     [t.token_id for t in want.output.tokens], list(want.output.logits), device.dtype, "the good item")


def test_in_process_client_reports_item_statuses(ex):
    """The in-process client runs the gRPC codec: per-item statuses with gRPC code numbers, a bad wire value
    (here an explicit top_p of 0) failing only its item, and call errors as RemoteError."""
    client = InProcessExecutorClient(ex)
    a = ex.prefill(PROMPT)
    resp = client.unified_decode_now([
        pb.UnifiedItem(cache_id=a.cache.cache_id, token_ids=[3], pos_offset=5, is_final_chunk=True),
        pb.UnifiedItem(cache_id="f" * 32, token_ids=[3], pos_offset=1, is_final_chunk=True),
        pb.UnifiedItem(token_ids=[3], is_final_chunk=True, sampling=cpb.SamplingParams(temperature=1, top_p=0)),
    ])
    codes = [r.status.code for r in resp.results]
    assert codes == [0, grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]]
    assert resp.results[0].cache.seq_len == 6 and resp.results[0].output.tokens
    assert resp.results[1].cache.cache_id == "f" * 32 and "item 1" in resp.results[1].status.message
    assert "item 2" in resp.results[2].status.message and "top_p" in resp.results[2].status.message
    assert not resp.results[1].HasField("output") and resp.kv.active_caches == 1
    with pytest.raises(RemoteError) as err:
        client.unified_decode_now([])
    assert err.value.status_name == "INVALID_ARGUMENT"
