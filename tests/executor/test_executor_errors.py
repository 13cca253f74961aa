"""Bad input and wrong state raise typed errors, change nothing, and leak no KV block."""
from __future__ import annotations

import pytest

from executor_service.types import CacheRef, DecodeItem, OutputOptions, UnifiedItem
from tandem.errors import (AdapterNotFound, CacheNotFound, CacheStateConflict, InvalidRequest, KvCapacityExceeded,
                           PositionMismatch,
                           SequenceTooLong)
from tandem.sampling_params import SamplingParams
from tests.executor_driver import LOGITS, make_executor, raising
from tests.hf_reference import rel_err


@pytest.fixture()
def ex(model_dir):
    return make_executor(model_dir, kv_blocks=12)  # 12 blocks x 16 tokens


def blocks_in_use(ex) -> int:
    u = ex.kv_usage()
    return u.total_blocks - u.free_blocks


def test_unknown_cache_id(ex):
    with pytest.raises(CacheNotFound, match="nope"):
        raising(ex.decode([DecodeItem(CacheRef("nope", 3), 5)]))
    with pytest.raises(CacheNotFound):
        ex.truncate_cache("nope", 0)
    with pytest.raises(CacheNotFound):
        ex.prefill([1, 2], cache_id="nope")
    assert ex.release_cache(["nope"]) == (0, ["nope"])


def test_decode_at_wrong_position_changes_nothing(ex):
    res = ex.prefill([5, 6, 7, 8], output=LOGITS)
    cid = res.cache.cache_id
    used = blocks_in_use(ex)
    for wrong in (3, 5, 0):
        with pytest.raises(PositionMismatch, match="holds 4 tokens"):
            raising(ex.decode([DecodeItem(CacheRef(cid, wrong), 9)]))
    assert ex.cache_length(cid) == 4 and blocks_in_use(ex) == used
    (good,) = ex.decode([DecodeItem(CacheRef(cid, 4), 9)], )
    fresh = ex.prefill([5, 6, 7, 8, 9], output=LOGITS)
    assert good.output.tokens[0].token_id == fresh.output.tokens[0].token_id


@pytest.mark.parametrize("tokens, match", [([], "empty"), ([1, 10**6], "outside the vocabulary"), ([-1], "outside")])
def test_bad_tokens(ex, tokens, match):
    with pytest.raises(InvalidRequest, match=match):
        ex.prefill(tokens)
    assert blocks_in_use(ex) == 0 and ex.kv_usage().active_caches == 0


def test_past_max_position(ex, model_dir):
    max_len = ex.info().max_seq_len
    with pytest.raises(SequenceTooLong, match=str(max_len)):
        ex.prefill([3] * (max_len + 1))
    # Exactly max_len fits only if the pool is big enough, so check the boundary on a bigger executor.
    big = make_executor(model_dir, kv_blocks=max_len // 16 + 1)
    res = big.prefill([3] * max_len)
    with pytest.raises(SequenceTooLong):
        raising(big.decode([DecodeItem(CacheRef(res.cache.cache_id, max_len), 4)]))
    assert big.cache_length(res.cache.cache_id) == max_len


def test_kv_capacity_is_all_or_nothing(ex):
    a = ex.prefill([3] * 100)  # 7 blocks
    with pytest.raises(KvCapacityExceeded, match="needs 7 more blocks but only 5"):
        ex.unified_decode([UnifiedItem((4,), a.cache.cache_id, 100), UnifiedItem((3,) * 100)])
    assert ex.cache_length(a.cache.cache_id) == 100 and blocks_in_use(ex) == 7
    ex.release_cache([a.cache.cache_id])
    assert blocks_in_use(ex) == 0


def test_one_bad_item_fails_alone(ex):
    """Each bad item gets its own typed error naming it and writes nothing; the good item beside it runs and
    answers as it would alone. Only an empty batch is an error of the call."""
    seq = [3, 4, 5]  # the tokens the cache holds
    a = ex.prefill(seq)
    cid = a.cache.cache_id
    tok = a.output.tokens[0].token_id
    bad_items = [
        (lambda n: UnifiedItem((7,), cid, n + 1), InvalidRequest, "appears twice"),  # same cache twice
        (lambda n: UnifiedItem((1, 2), None, 2), InvalidRequest, "starts at pos_offset 0"),
        (lambda n: UnifiedItem((1,), None, 0, adapter="x"), AdapterNotFound, "adapter 'x'"),
        (lambda n: UnifiedItem((1,), None, 0, sampling=SamplingParams(temperature=-1)), InvalidRequest,
         "temperature"),
        (lambda n: UnifiedItem((1,), None, 0, output=OutputOptions(top_logprobs=999)), InvalidRequest,
         "top_logprobs"),
        (lambda n: UnifiedItem((1, 10**6), None, 0), InvalidRequest, "outside the vocabulary"),
    ]
    for make_bad, error, match in bad_items:
        n = ex.cache_length(cid)
        good, bad = ex.unified_decode([UnifiedItem((tok,), cid, n), make_bad(n)])
        assert good.error is None and good.cache == CacheRef(cid, n + 1)
        assert isinstance(bad.error, error) and match in str(bad.error) and str(bad.error).startswith("item 1")
        assert bad.output is None
        assert ex.kv_usage().active_caches == 1  # no cache was created for the bad item
        seq.append(tok)
        alone = ex.prefill(seq)  # the same tokens as one prompt
        assert good.output.tokens[0].token_id == alone.output.tokens[0].token_id
        ex.release_cache([alone.cache.cache_id])
        tok = good.output.tokens[0].token_id
    with pytest.raises(InvalidRequest, match="no items"):
        ex.unified_decode([])
    assert blocks_in_use(ex) == 1 and ex.kv_usage().active_caches == 1


def test_batch_token_limit(model_dir):
    ex = make_executor(model_dir, max_batch_tokens=8)
    with pytest.raises(InvalidRequest, match="max-batch-tokens"):
        ex.prefill(list(range(3, 12)))


def test_truncate_beyond_length(ex):
    a = ex.prefill([3, 4, 5])
    with pytest.raises(PositionMismatch, match="holds 3 tokens"):
        ex.truncate_cache(a.cache.cache_id, 4)
    assert ex.truncate_cache(a.cache.cache_id, 0).seq_len == 0
    assert blocks_in_use(ex) == 0  # length 0 keeps no block
    (r,) = ex.unified_decode([UnifiedItem((3, 4, 5), a.cache.cache_id, 0, output=LOGITS)])
    fresh = ex.prefill([3, 4, 5], output=LOGITS)
    assert rel_err(r.output.logits[0], fresh.output.logits[0]) < 1e-5


def test_release_is_idempotent(ex):
    a = ex.prefill([3, 4, 5])
    assert ex.release_cache([a.cache.cache_id, a.cache.cache_id]) == (1, [a.cache.cache_id])
    assert ex.release_cache([a.cache.cache_id]) == (0, [a.cache.cache_id])
    assert blocks_in_use(ex) == 0


def test_multi_step_decode_stops_when_pool_fills(ex):
    a = ex.prefill([3] * 175)  # 11 blocks of 12, 1 slot left in the last block
    (d,) = ex.decode([DecodeItem(CacheRef(a.cache.cache_id, 175), 4)], num_steps=40)
    # 16 more tokens fit (1 + one more block of 16 = positions 175..191): then the pool is full.
    assert len(d.output.tokens) == 17 and d.cache.seq_len == 192
    assert ex.kv_usage().free_blocks == 0
    with pytest.raises(KvCapacityExceeded):
        ex.decode([DecodeItem(CacheRef(a.cache.cache_id, 192), 4)])
    ex.release_cache([a.cache.cache_id])
    assert blocks_in_use(ex) == 0


def test_prefill_cannot_continue_a_decoding_cache(ex):
    a = ex.prefill([3, 4, 5])
    b = ex.prefill([6, 7], cache_id=a.cache.cache_id)  # a chunked prompt may keep growing...
    assert b.cache.seq_len == 5
    ex.decode([DecodeItem(CacheRef(a.cache.cache_id, 5), b.output.tokens[0].token_id)])
    with pytest.raises(CacheStateConflict, match="already decoding"):  # ...until decoding starts
        ex.prefill([8], cache_id=a.cache.cache_id)
    assert ex.cache_length(a.cache.cache_id) == 6
