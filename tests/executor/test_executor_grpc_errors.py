"""Bad input and wrong state over gRPC: the exact status code, an actionable message, nothing half-written,
and the server keeps serving. One shared server: 24 KV blocks, --max-batch-tokens 300, --max-message-mb 1.

A Decode or UnifiedDecode item that is wrong on its own answers OK with that item's status (code + message);
the matrix's single-item cases read the code there. Mixed batches (bad items beside good ones) are
tests/executor/test_item_status_grpc.py's."""
from __future__ import annotations

import math
import re
from typing import Callable

import grpc
import pytest

from tandem.common.v1 import common_pb2 as cpb

from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_for

KV_BLOCKS = 24  # x 16 tokens
MAX_BATCH_TOKENS = 300
MAX_LEN = 256  # the tiny checkpoint's max_position_embeddings
VOCAB = 448
UNKNOWN = "0123456789abcdef0123456789abcdef"  # well-formed, never issued
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def server(request, tiny_checkpoint):
    return start_for(request, tiny_checkpoint("llama"), "--kv-blocks", str(KV_BLOCKS), "--max-batch-tokens",
                     str(MAX_BATCH_TOKENS), "--max-message-mb", "1")


class Ctx:
    """Creates the state a case needs, remembers every cache's length to prove nothing moved, cleans up."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.lengths: dict[str, int] = {}

    def prefill(self, tokens: list[int], cache_id: str = "") -> tuple[str, int, int]:
        """(cache id, its length, the token sampled after it)."""
        r = self.stub.Prefill(pb.PrefillRequest(token_ids=tokens, cache_id=cache_id))
        self.lengths[r.cache.cache_id] = r.cache.seq_len
        return r.cache.cache_id, r.cache.seq_len, r.output.tokens[0].token_id

    def cache(self, n: int = 5) -> tuple[str, int, int]:
        return self.prefill([3 + i % 300 for i in range(n)])

    def decoding_cache(self) -> tuple[str, int, int]:
        """A cache that has decoded one token (its prompt can no longer grow)."""
        cid, n, tok = self.cache()
        (d,) = self.stub.Decode(pb.DecodeRequest(items=[decode_item(cid, n, tok)])).results
        self.lengths[cid] = d.cache.seq_len
        return cid, d.cache.seq_len, d.output.tokens[0].token_id

    def release(self, cid: str) -> None:
        self.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[cid]))
        del self.lengths[cid]

    def fill_kv(self) -> dict[str, tuple[int, int]]:
        """Leaves exactly 1 free block: a 240-token cache (15 full blocks) and a 120-token one (8 blocks,
        8 free slots in its last). Returns {name: (id, length)}."""
        a, na, _ = self.cache(240)
        b, nb, _ = self.cache(120)
        assert self.kv() == (1, 2)
        return {"full": (a, na), "slack": (b, nb)}

    def kv(self) -> tuple[int, int]:
        k = self.stub.GetInfo(pb.GetInfoRequest()).kv
        return k.free_blocks, k.active_caches

    def check_lengths(self) -> None:
        """Every cache still holds exactly the tokens it held: truncating to that length is a no-op that
        succeeds (so it holds at least that many), one more is refused (so it holds no more)."""
        for cid, n in self.lengths.items():
            t = self.stub.TruncateCache(pb.TruncateCacheRequest(cache_id=cid, new_len=n))
            assert t.cache.seq_len == n
            with pytest.raises(grpc.RpcError) as err:
                self.stub.TruncateCache(pb.TruncateCacheRequest(cache_id=cid, new_len=n + 1))
            assert err.value.code() == Code.FAILED_PRECONDITION, f"cache {cid} grew past {n}"

    def release_all(self) -> None:
        if self.lengths:
            r = self.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=list(self.lengths)))
            assert r.released == len(self.lengths) and not r.unknown_cache_ids
            self.lengths.clear()


def decode_item(cid: str, pos: int, token: int, **kw) -> pb.DecodeItem:
    return pb.DecodeItem(cache=pb.CacheRef(cache_id=cid, seq_len=pos), token_id=token, **kw)


def sampled_prefill(stub, **sampling) -> Callable[[], object]:
    return lambda: stub.Prefill(pb.PrefillRequest(token_ids=[5, 6, 7], sampling=cpb.SamplingParams(**sampling)))


# Each case: (name, expected code, regex the details must match or None, setup(ctx) -> the failing call).
CaseFn = Callable[[Ctx], Callable[[], object]]
CASES: list = []


def case(code: grpc.StatusCode, match: str | None = None):
    def register(fn: CaseFn) -> CaseFn:
        CASES.append(pytest.param(fn, code, match, id=fn.__name__))
        return fn
    return register


# ------------------------------------------------------------------------------------------ NOT_FOUND
@case(Code.NOT_FOUND, UNKNOWN)
def decode_unknown_cache(c):
    return lambda: c.stub.Decode(pb.DecodeRequest(items=[decode_item(UNKNOWN, 3, 5)]))


@case(Code.NOT_FOUND, "never created or has been released")
def decode_released_cache(c):
    cid, n, tok = c.cache()
    c.release(cid)
    return lambda: c.stub.Decode(pb.DecodeRequest(items=[decode_item(cid, n, tok)]))


@case(Code.NOT_FOUND, UNKNOWN)
def truncate_unknown_cache(c):
    return lambda: c.stub.TruncateCache(pb.TruncateCacheRequest(cache_id=UNKNOWN, new_len=0))


@case(Code.NOT_FOUND, UNKNOWN)
def forward_verify_unknown_cache(c):
    return lambda: c.stub.ForwardVerify(pb.ForwardVerifyRequest(cache=pb.CacheRef(cache_id=UNKNOWN, seq_len=3),
                                                                token_ids=[5, 6]))


@case(Code.NOT_FOUND, UNKNOWN)
def prefill_continues_unknown_cache(c):
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[5, 6], cache_id=UNKNOWN))


@case(Code.NOT_FOUND, UNKNOWN)
def unified_unknown_cache(c):
    return lambda: c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
        pb.UnifiedItem(cache_id=UNKNOWN, token_ids=[5], pos_offset=3, is_final_chunk=True)]))


@case(Code.NOT_FOUND, "adapter 'nope' is not loaded")
def prefill_unknown_adapter(c):
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[5, 6], adapter="nope"))


@case(Code.NOT_FOUND, r"item 0: items\[0\]\.adapter 'nope' is not loaded")
def unified_unknown_adapter(c):
    return lambda: c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
        pb.UnifiedItem(token_ids=[5, 6], is_final_chunk=True, adapter="nope")]))


# -------------------------------------------------------------------------------- FAILED_PRECONDITION
@case(Code.FAILED_PRECONDITION, r"holds 5 tokens.*position 5")
def decode_behind_position(c):
    cid, n, tok = c.cache(5)
    return lambda: c.stub.Decode(pb.DecodeRequest(items=[decode_item(cid, n - 1, tok)]))


@case(Code.FAILED_PRECONDITION, "holds 5 tokens")
def decode_ahead_of_position(c):
    cid, n, tok = c.cache(5)
    return lambda: c.stub.Decode(pb.DecodeRequest(items=[decode_item(cid, n + 1, tok)]))


@case(Code.FAILED_PRECONDITION, r"position 2 .*the cache holds 5")
def unified_pos_offset_mismatch(c):
    cid, n, tok = c.cache(5)
    return lambda: c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
        pb.UnifiedItem(cache_id=cid, token_ids=[tok], pos_offset=2, is_final_chunk=True)]))


@case(Code.FAILED_PRECONDITION, "holds 5 tokens")
def forward_verify_wrong_position(c):
    cid, n, tok = c.cache(5)
    return lambda: c.stub.ForwardVerify(pb.ForwardVerifyRequest(cache=pb.CacheRef(cache_id=cid, seq_len=n + 3),
                                                                token_ids=[tok, 7]))


@case(Code.FAILED_PRECONDITION, "holds 5 tokens; cannot truncate it to 6")
def truncate_beyond_length(c):
    cid, n, _ = c.cache(5)
    return lambda: c.stub.TruncateCache(pb.TruncateCacheRequest(cache_id=cid, new_len=n + 1))


@case(Code.FAILED_PRECONDITION, "already decoding.*use Decode or UnifiedDecode")
def prefill_continues_decoding_cache(c):
    cid, _, _ = c.decoding_cache()
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[8, 9], cache_id=cid))


# ----------------------------------------------------------------------------------- INVALID_ARGUMENT
@case(Code.INVALID_ARGUMENT, r"^token_ids holds token id 448, outside the vocabulary \[0, 448\)")
def prefill_token_id_at_vocab(c):
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[5, VOCAB]))


@case(Code.INVALID_ARGUMENT, "outside the vocabulary")
def decode_token_id_huge(c):
    cid, n, _ = c.cache()
    return lambda: c.stub.Decode(pb.DecodeRequest(items=[decode_item(cid, n, 2**32 - 1)]))


@case(Code.INVALID_ARGUMENT, "token_ids is empty")
def prefill_empty_token_ids(c):
    return lambda: c.stub.Prefill(pb.PrefillRequest())


@case(Code.INVALID_ARGUMENT, r"item 0: items\[0\]\.token_ids is empty")
def unified_item_empty_token_ids(c):
    return lambda: c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(is_final_chunk=True)]))


@case(Code.INVALID_ARGUMENT, "token_ids is empty")
def forward_verify_empty_token_ids(c):
    cid, n, _ = c.cache()
    return lambda: c.stub.ForwardVerify(pb.ForwardVerifyRequest(cache=pb.CacheRef(cache_id=cid, seq_len=n)))


@case(Code.INVALID_ARGUMENT, "cache_id")
def forward_verify_without_cache_id(c):
    return lambda: c.stub.ForwardVerify(pb.ForwardVerifyRequest(token_ids=[5, 6]))


@case(Code.INVALID_ARGUMENT, "at least one item")
def decode_without_items(c):
    return lambda: c.stub.Decode(pb.DecodeRequest(num_steps=2))


@case(Code.INVALID_ARGUMENT, "cache_id")
def decode_item_without_cache_id(c):
    return lambda: c.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(token_id=5)]))


@case(Code.INVALID_ARGUMENT, "no items")
def unified_without_items(c):
    return lambda: c.stub.UnifiedDecode(pb.UnifiedDecodeRequest())


@case(Code.INVALID_ARGUMENT, r"temperature must be >= 0")
def temperature_negative(c):
    return sampled_prefill(c.stub, temperature=-0.5)


@case(Code.INVALID_ARGUMENT, "temperature must be a finite number")
def temperature_nan(c):
    return sampled_prefill(c.stub, temperature=math.nan)


@case(Code.INVALID_ARGUMENT, "temperature must be a finite number")
def temperature_inf(c):
    return sampled_prefill(c.stub, temperature=math.inf)


@case(Code.INVALID_ARGUMENT, r"top_p must be in \(0, 1\] \(leave it unset for off\)")
def top_p_explicit_zero(c):
    return sampled_prefill(c.stub, temperature=1.0, top_p=0.0)


@case(Code.INVALID_ARGUMENT, "top_p")
def top_p_above_one(c):
    return sampled_prefill(c.stub, temperature=1.0, top_p=1.5)


@case(Code.INVALID_ARGUMENT, "top_p")
def top_p_nan(c):
    return sampled_prefill(c.stub, temperature=1.0, top_p=math.nan)


@case(Code.INVALID_ARGUMENT, "min_p")
def min_p_above_one(c):
    return sampled_prefill(c.stub, temperature=1.0, min_p=1.5)


@case(Code.INVALID_ARGUMENT, "repetition_penalty")
def repetition_penalty_negative(c):
    return sampled_prefill(c.stub, repetition_penalty=-1.0)


@case(Code.INVALID_ARGUMENT, "repetition_penalty must be a finite number")
def repetition_penalty_nan(c):
    return sampled_prefill(c.stub, repetition_penalty=math.nan)


@case(Code.INVALID_ARGUMENT, r"presence_penalty must be in \[-2, 2\]")
def presence_penalty_5(c):
    return sampled_prefill(c.stub, presence_penalty=5.0)


@case(Code.INVALID_ARGUMENT, "frequency_penalty")
def frequency_penalty_minus_3(c):
    return sampled_prefill(c.stub, frequency_penalty=-3.0)


@case(Code.INVALID_ARGUMENT, "logit_bias names token 448, outside the vocabulary")
def logit_bias_token_at_vocab(c):
    return sampled_prefill(c.stub, logit_bias={VOCAB: 1.0})


@case(Code.INVALID_ARGUMENT, r"sampling.logit_bias of token 7 must be in \[-100, 100\]")
def logit_bias_1000(c):
    return sampled_prefill(c.stub, logit_bias={7: 1000.0})


@case(Code.INVALID_ARGUMENT, "logit_bias")
def logit_bias_nan(c):
    return sampled_prefill(c.stub, logit_bias={7: math.nan})


@case(Code.INVALID_ARGUMENT, r"top_logprobs must be in \[0, 20\]")
def top_logprobs_50(c):
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[5, 6], output=pb.OutputOptions(top_logprobs=50)))


@case(Code.INVALID_ARGUMENT, "num_steps must be <= 256")
def decode_num_steps_1000(c):
    cid, n, tok = c.cache()
    return lambda: c.stub.Decode(pb.DecodeRequest(items=[decode_item(cid, n, tok)], num_steps=1000))


@case(Code.INVALID_ARGUMENT, "output mode must include tokens")
def multi_step_decode_in_logits_mode(c):
    cid, n, tok = c.cache()
    return lambda: c.stub.Decode(pb.DecodeRequest(num_steps=2, items=[
        decode_item(cid, n, tok, output=pb.OutputOptions(mode=pb.OUTPUT_MODE_LOGITS))]))


@case(Code.INVALID_ARGUMENT, "new cache .* starts at pos_offset 0")
def unified_new_cache_with_pos_offset(c):
    return lambda: c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
        pb.UnifiedItem(token_ids=[5, 6], pos_offset=3, is_final_chunk=True)]))


@case(Code.INVALID_ARGUMENT, "carries 301 tokens.*at most 300 per call \\(--max-batch-tokens\\): split it")
def prefill_over_max_batch_tokens(c):
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[5] * (MAX_BATCH_TOKENS + 1)))


@case(Code.INVALID_ARGUMENT, "max-batch-tokens")
def unified_over_max_batch_tokens_in_total(c):
    return lambda: c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
        pb.UnifiedItem(token_ids=[5] * 150, is_final_chunk=True),
        pb.UnifiedItem(token_ids=[6] * 151, is_final_chunk=True)]))


@case(Code.INVALID_ARGUMENT, "output.mode 7 is not a known OutputMode")
def output_mode_unknown_enum(c):
    # proto3 enums are open: an unknown number travels and must be refused by the server.
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[5, 6], output=pb.OutputOptions(mode=7)))


@case(Code.INVALID_ARGUMENT, "logits_dtype 9")
def logits_dtype_unknown_enum(c):
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[5, 6], output=pb.OutputOptions(
        mode=pb.OUTPUT_MODE_LOGITS, logits_dtype=9)))


@case(Code.INVALID_ARGUMENT, r"item 0: items\[0\]\.output\.mode 7")
def unified_output_mode_unknown_enum(c):
    return lambda: c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
        pb.UnifiedItem(token_ids=[5, 6], is_final_chunk=True, output=pb.OutputOptions(mode=7))]))


# ---------------------------------------------------------------------------------------- OUT_OF_RANGE
@case(Code.OUT_OF_RANGE, "0 \\+ 257 tokens exceed the model's maximum length of 256")
def prefill_past_max_len(c):
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[5] * (MAX_LEN + 1)))


@case(Code.OUT_OF_RANGE, "200 \\+ 57 tokens exceed")
def prefill_continuation_past_max_len(c):
    cid, _, _ = c.cache(200)
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[5] * 57, cache_id=cid))


@case(Code.OUT_OF_RANGE, "256 \\+ 1 tokens exceed")
def decode_at_max_len(c):
    cid, n, tok = c.cache(MAX_LEN)
    return lambda: c.stub.Decode(pb.DecodeRequest(items=[decode_item(cid, n, tok)]))


@case(Code.OUT_OF_RANGE, "maximum length")
def forward_verify_past_max_len(c):
    cid, n, tok = c.cache(250)
    return lambda: c.stub.ForwardVerify(pb.ForwardVerifyRequest(cache=pb.CacheRef(cache_id=cid, seq_len=n),
                                                                token_ids=[tok] + [5] * 6))


# ---------------------------------------------------------------------------------- RESOURCE_EXHAUSTED
@case(Code.RESOURCE_EXHAUSTED, "needs 3 more blocks but only 1 of 24 are free; release finished caches")
def kv_full_prefill(c):
    c.fill_kv()
    return lambda: c.stub.Prefill(pb.PrefillRequest(token_ids=[5] * 40))


@case(Code.RESOURCE_EXHAUSTED, "KV cache full")
def kv_full_mixed_batch_is_all_or_nothing(c):
    caches = c.fill_kv()
    cid, n = caches["slack"]  # its decode alone would fit in its last block...
    return lambda: c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
        pb.UnifiedItem(cache_id=cid, token_ids=[5], pos_offset=n, is_final_chunk=True),
        pb.UnifiedItem(token_ids=[6] * 20, is_final_chunk=True)]))  # ...but this needs 2 blocks


@case(Code.RESOURCE_EXHAUSTED, "KV cache full")
def kv_full_forward_verify(c):
    cid, n = c.fill_kv()["slack"]
    return lambda: c.stub.ForwardVerify(pb.ForwardVerifyRequest(cache=pb.CacheRef(cache_id=cid, seq_len=n),
                                                                token_ids=[5] * 30))


@case(Code.RESOURCE_EXHAUSTED, "needs 1 more blocks but only 0")
def kv_full_multi_step_decode_first_step(c):
    caches = c.fill_kv()
    c.cache(16)  # the last free block
    cid, n = caches["full"]
    return lambda: c.stub.Decode(pb.DecodeRequest(items=[decode_item(cid, n, 5)], num_steps=4))


@case(Code.RESOURCE_EXHAUSTED, r"reply to this Decode could take 1\.3 MiB, over this executor's 1 MiB message "
                              r"limit \(--max-message-mb\); nothing was run: send fewer items, steps")
def decode_reply_over_max_message_mb(c):
    # 3 items x 256 steps x a float32 logits row of 448 values (1792 bytes): ~1.3 MiB, refused before running.
    items = [decode_item(cid, n, tok, output=pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS))
             for cid, n, tok in (c.cache(5), c.cache(6), c.cache(7))]
    return lambda: c.stub.Decode(pb.DecodeRequest(items=items, num_steps=256))


@case(Code.RESOURCE_EXHAUSTED, "larger than max")
def message_over_max_message_mb(c):
    # Rejected by gRPC itself before the servicer runs: RESOURCE_EXHAUSTED is gRPC's code for it.
    request = pb.PrefillRequest(token_ids=[VOCAB - 1] * 600_000)  # 2-byte varints: ~1.2 MB
    assert request.ByteSize() > 1 << 20
    return lambda: c.stub.Prefill(request)


def assert_serving_normally(stub) -> None:
    """A small Prefill + Decode + ReleaseCache works and KV is back to all free blocks."""
    r = stub.Prefill(pb.PrefillRequest(token_ids=[5, 6, 7], output=pb.OutputOptions(top_logprobs=2)))
    assert r.cache.seq_len == 3 and len(r.output.tokens[0].top_logprobs) == 2
    (d,) = stub.Decode(pb.DecodeRequest(items=[decode_item(r.cache.cache_id, 3, r.output.tokens[0].token_id)])).results
    assert d.cache.seq_len == 4
    rel = stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[r.cache.cache_id]))
    assert rel.released == 1
    assert (rel.kv.free_blocks, rel.kv.total_blocks, rel.kv.active_caches) == (KV_BLOCKS, KV_BLOCKS, 0)


CODE_OF_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def outcome(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status a failing call ends with: the call's own, or (a one-item Decode or UnifiedDecode that
    answered) its item's."""
    try:
        response = call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    (result,) = response.results
    return CODE_OF_NUMBER[result.status.code], result.status.message


def test_matrix_is_large_enough():
    assert len(CASES) >= 25
    assert {p.values[1] for p in CASES} == {Code.NOT_FOUND, Code.FAILED_PRECONDITION, Code.INVALID_ARGUMENT,
                                            Code.OUT_OF_RANGE, Code.RESOURCE_EXHAUSTED}


@pytest.mark.parametrize("setup, code, match", CASES)
def test_bad_request(stub, setup: CaseFn, code: grpc.StatusCode, match: str | None):
    ctx = Ctx(stub)
    try:
        call = setup(ctx)
        before = ctx.kv()
        got, details = outcome(call)
        assert got == code, f"got {got}: {details}"
        assert details.strip(), "the status carries no message"
        if match:
            assert re.search(match, details), f"{details!r} does not match {match!r}"
        assert ctx.kv() == before, "the failed call changed KV usage (blocks or caches)"
        ctx.check_lengths()
    finally:
        ctx.release_all()
    assert_serving_normally(stub)


# ------------------------------------------------------------- edges that are valid, not errors
@pytest.mark.parametrize("sampling", [
    dict(temperature=1.0, top_k=10**6),  # larger than the vocabulary: keeps everything
    dict(temperature=1.0, top_p=1.0),
    dict(temperature=1.0, min_p=1.0),
    dict(repetition_penalty=0.0),
    dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(logit_bias={VOCAB - 1: 100.0, 0: -100.0}),
    dict(seed=2**64 - 1, temperature=0.7),
], ids=["top_k_huge", "top_p_1", "min_p_1", "repetition_penalty_0", "penalties_at_bounds", "logit_bias_bounds",
        "seed_max"])
def test_boundary_values_are_accepted(stub, sampling):
    r = stub.Prefill(pb.PrefillRequest(token_ids=[5, 6, 7], sampling=cpb.SamplingParams(**sampling),
                                       output=pb.OutputOptions(top_logprobs=20)))
    try:
        assert len(r.output.tokens) == 1 and len(r.output.tokens[0].top_logprobs) == 20
        if "logit_bias" in sampling:
            assert r.output.tokens[0].token_id == VOCAB - 1  # +100 wins the greedy pick
    finally:
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[r.cache.cache_id]))
    assert_serving_normally(stub)


def test_multi_step_decode_stops_when_kv_fills_without_error(stub):
    """If the pool fills after the first step, the Decode returns the steps it took (no error)."""
    ctx = Ctx(stub)
    try:
        caches = ctx.fill_kv()
        cid, n = caches["slack"]  # 8 free slots in its last block + 1 free block of 16
        (d,) = stub.Decode(pb.DecodeRequest(items=[decode_item(cid, n, 5)], num_steps=40)).results
        assert len(d.output.tokens) == 8 + 16 and d.cache.seq_len == n + 24
        assert ctx.kv() == (0, 2)
    finally:
        ctx.release_all()
    assert_serving_normally(stub)
