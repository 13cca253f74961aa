"""Every ExecutorService RPC against the real server process (tiny llama checkpoint), checked against the
in-process Executor on the same directory; plus health, reflection and SIGTERM while an RPC is in flight."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from executor_service.rpc import codec
from executor_service.types import CacheRef, DecodeItem, OutputMode, OutputOptions, UnifiedItem
from tandem.sampling_params import SamplingParams
from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as pb
from tests.executor_driver import LOGITS, greedy_run, make_executor
from tests.grpc_harness import start_executor, start_for

SERVICE = "tandem.executor.v1.ExecutorService"
KV_BLOCKS = 64
VOCAB = 448  # the tiny checkpoint's (padded) vocabulary
WITH_LOGITS = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS)
F32_TOL = dict(rtol=1e-6, atol=1e-6)  # same computation, same CPU: in practice bit-identical
# Same numbers reached another way (chunked vs whole prompt, verify vs decode): float32 summation order.
OTHER_PATH_TOL = dict(rtol=1e-5, atol=1e-5)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


@pytest.fixture(scope="module")
def server(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", str(KV_BLOCKS))


@pytest.fixture(scope="module")
def local(model_dir):
    """The in-process Executor on the same checkpoint: the reference for every gRPC answer."""
    return make_executor(model_dir, kv_blocks=KV_BLOCKS)


@pytest.fixture(autouse=True)
def no_leaks(stub, local):
    """Every test releases what it created: the server (and the local executor) end where they started."""
    yield
    kv = stub.GetInfo(pb.GetInfoRequest()).kv
    assert (kv.free_blocks, kv.active_caches) == (KV_BLOCKS, 0), kv
    u = local.kv_usage()
    assert (u.free_blocks, u.active_caches) == (KV_BLOCKS, 0), u


def logits_of(out: pb.SequenceOutput) -> np.ndarray:
    assert out.HasField("logits")
    return codec.decode_logits(out.logits)


def release(stub, *cache_ids: str) -> pb.ReleaseCacheResponse:
    return stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=list(cache_ids)))


# --------------------------------------------------------------------------------------------- GetInfo
def test_get_info(stub, local, model_dir):
    info = stub.GetInfo(pb.GetInfoRequest())
    ref = local.info()
    assert info.architecture == "LlamaForCausalLM" == ref.architecture
    assert info.model_id == model_dir.name and info.model_dir == str(model_dir)
    assert (info.vocab_size, info.hidden_size, info.num_layers, info.num_heads, info.num_kv_heads,
            info.head_dim, info.max_seq_len) == (VOCAB, 64, 2, 4, 2, 16, 256)
    assert (info.vocab_size, info.hidden_size, info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim,
            info.max_seq_len) == (ref.vocab_size, ref.hidden_size, ref.num_layers, ref.num_heads, ref.num_kv_heads,
                                  ref.head_dim, ref.max_seq_len)
    assert (info.dtype, info.device, info.quantization) == ("float32", "cpu", "none")
    assert (info.kv_dtype, info.attention_backend) == ("float32", "gathered") == (ref.kv_dtype, ref.attention_backend)
    assert list(info.eos_token_ids) == list(ref.eos_token_ids) == [2]
    assert info.HasField("bos_token_id") and info.bos_token_id == ref.bos_token_id == 1
    assert (info.kv.block_size, info.kv.total_blocks, info.kv.free_blocks, info.kv.active_caches) == (
        16, KV_BLOCKS, KV_BLOCKS, 0)
    assert list(info.capabilities) == list(ref.capabilities)
    assert {"unified_decode", "forward_verify", "multi_step_decode", "chunked_prefill"} <= set(info.capabilities)
    assert list(info.adapters) == []
    assert info.max_batch_tokens == 8192


# --------------------------------------------------------------------------------------------- Prefill
def test_prefill_tokens_logprobs_top_logprobs(stub, local):
    prompt = prompt_of(21, seed=1)
    opts = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS, top_logprobs=5)
    res = stub.Prefill(pb.PrefillRequest(token_ids=prompt, output=opts))
    ref = local.prefill(prompt, output=OutputOptions(OutputMode.TOKENS_AND_LOGITS, top_logprobs=5))
    try:
        assert len(res.cache.cache_id) == 32 and int(res.cache.cache_id, 16) >= 0  # 32 hex characters
        assert res.cache.seq_len == len(prompt) and res.cached_tokens == 0
        assert (res.kv.free_blocks, res.kv.active_caches) == (KV_BLOCKS - 2, 1)  # 21 tokens: 2 blocks of 16
        (tok,) = res.output.tokens
        (ref_tok,) = ref.output.tokens
        assert tok.token_id == ref_tok.token_id
        assert tok.logprob == pytest.approx(ref_tok.logprob, abs=1e-5)
        assert [t.token_id for t in tok.top_logprobs] == [i for i, _ in ref_tok.top_logprobs]
        assert [t.logprob for t in tok.top_logprobs] == pytest.approx([lp for _, lp in ref_tok.top_logprobs],
                                                                     abs=1e-5)
        # Greedy: the chosen token is the best alternative; alternatives are sorted; logprobs are the raw
        # log-softmax of the returned logits.
        lps = [t.logprob for t in tok.top_logprobs]
        assert tok.top_logprobs[0].token_id == tok.token_id and lps == sorted(lps, reverse=True)
        logits = logits_of(res.output)
        assert logits.shape == (1, VOCAB)
        np.testing.assert_allclose(logits, ref.output.logits.numpy(), **F32_TOL)
        log_softmax = torch.log_softmax(torch.from_numpy(logits[0].copy()), -1)
        assert tok.logprob == pytest.approx(float(log_softmax[tok.token_id]), abs=1e-4)
        assert int(log_softmax.argmax()) == tok.token_id
    finally:
        release(stub, res.cache.cache_id)
        local.release_cache([ref.cache.cache_id])


def test_concurrent_prefills_match_serial(stub):
    """RPC threads run side by side; the model lock serialises them; answers do not depend on it."""
    prompts = [prompt_of(n, seed=n) for n in (5, 9, 17, 30)]
    serial = [stub.Prefill(pb.PrefillRequest(token_ids=p)) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(lambda p: stub.Prefill(pb.PrefillRequest(token_ids=p)), prompts))
    assert [r.output.tokens[0].token_id for r in parallel] == [r.output.tokens[0].token_id for r in serial]
    ids = {r.cache.cache_id for r in serial + parallel}
    assert len(ids) == 8
    assert release(stub, *ids).released == 8


# ------------------------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_by_prefill_continuation(stub, local):
    prompt = prompt_of(40, seed=2)
    ref = local.prefill(prompt, output=LOGITS)
    first = stub.Prefill(pb.PrefillRequest(token_ids=prompt[:16], output=WITH_LOGITS))
    cid = first.cache.cache_id
    try:
        assert first.cache.seq_len == 16
        second = stub.Prefill(pb.PrefillRequest(token_ids=prompt[16:33], cache_id=cid, output=WITH_LOGITS))
        assert (second.cache.cache_id, second.cache.seq_len) == (cid, 33)
        last = stub.Prefill(pb.PrefillRequest(token_ids=prompt[33:], cache_id=cid, output=WITH_LOGITS))
        assert (last.cache.cache_id, last.cache.seq_len) == (cid, 40)
        assert last.kv.active_caches == 1 and last.kv.free_blocks == KV_BLOCKS - 3
        assert last.output.tokens[0].token_id == ref.output.tokens[0].token_id
        np.testing.assert_allclose(logits_of(last.output), ref.output.logits.numpy(), **OTHER_PATH_TOL)
        # The chunked cache decodes exactly like the whole prompt's.
        token = last.output.tokens[0].token_id
        (d,) = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(
            cache=pb.CacheRef(cache_id=cid, seq_len=40), token_id=token, output=WITH_LOGITS)])).results
        (ref_d,) = local.decode([DecodeItem(CacheRef(ref.cache.cache_id, 40), token, output=LOGITS)])
        assert d.output.tokens[0].token_id == ref_d.output.tokens[0].token_id
        np.testing.assert_allclose(logits_of(d.output), ref_d.output.logits.numpy(), **OTHER_PATH_TOL)
    finally:
        release(stub, cid)
        local.release_cache([ref.cache.cache_id])


def test_chunked_prefill_by_unified_decode(stub, local):
    prompt = prompt_of(30, seed=3)
    ref_cid, ref_tokens, ref_logits = greedy_run(local, prompt, steps=1, chunk=10)  # the same chunks
    local.release_cache([ref_cid])
    whole = local.prefill(prompt, output=LOGITS)
    local.release_cache([whole.cache.cache_id])
    cid, pos = "", 0
    for chunk in (prompt[:10], prompt[10:20], prompt[20:]):
        final = pos + len(chunk) == len(prompt)
        resp = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(
            cache_id=cid, token_ids=chunk, pos_offset=pos, is_final_chunk=final, output=WITH_LOGITS)]))
        (r,) = resp.results
        assert r.HasField("output") == final  # output only for the final chunk
        if cid:
            assert r.cache.cache_id == cid
        cid, pos = r.cache.cache_id, pos + len(chunk)
        assert r.cache.seq_len == pos and resp.kv.active_caches == 1
    try:
        assert r.output.tokens[0].token_id == ref_tokens[0] == whole.output.tokens[0].token_id
        np.testing.assert_allclose(logits_of(r.output)[0], ref_logits[0].numpy(), **F32_TOL)
        np.testing.assert_allclose(logits_of(r.output), whole.output.logits.numpy(), **OTHER_PATH_TOL)
    finally:
        release(stub, cid)


# ------------------------------------------------------------------------------------- mixed batches
def test_mixed_unified_batch(stub, local):
    """One forward: a decode of A, a whole new prompt C, a decode of B, the first chunk of a new D.
    Results come in request order; only final chunks (and decodes) carry output."""
    pa, pb_, pc, pd = prompt_of(11, 4), prompt_of(18, 5), prompt_of(9, 6), prompt_of(25, 7)
    grpc_ids, local_ids = [], []
    try:
        a = stub.Prefill(pb.PrefillRequest(token_ids=pa))
        b = stub.Prefill(pb.PrefillRequest(token_ids=pb_))
        grpc_ids += [a.cache.cache_id, b.cache.cache_id]
        la, lb = local.prefill(pa), local.prefill(pb_)
        local_ids += [la.cache.cache_id, lb.cache.cache_id]
        ta, tb = a.output.tokens[0].token_id, b.output.tokens[0].token_id
        assert (ta, tb) == (la.output.tokens[0].token_id, lb.output.tokens[0].token_id)

        resp = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
            pb.UnifiedItem(cache_id=a.cache.cache_id, token_ids=[ta], pos_offset=len(pa), is_final_chunk=True,
                           output=WITH_LOGITS),
            pb.UnifiedItem(token_ids=pc, is_final_chunk=True, output=WITH_LOGITS),
            pb.UnifiedItem(cache_id=b.cache.cache_id, token_ids=[tb], pos_offset=len(pb_), is_final_chunk=True,
                           output=WITH_LOGITS),
            pb.UnifiedItem(token_ids=pd[:16], is_final_chunk=False, output=WITH_LOGITS),
        ]))
        ra, rc, rb, rd = resp.results
        grpc_ids += [rc.cache.cache_id, rd.cache.cache_id]
        assert (ra.cache.cache_id, ra.cache.seq_len) == (a.cache.cache_id, len(pa) + 1)
        assert (rb.cache.cache_id, rb.cache.seq_len) == (b.cache.cache_id, len(pb_) + 1)
        assert rc.cache.seq_len == len(pc) and rd.cache.seq_len == 16
        assert len({ra.cache.cache_id, rb.cache.cache_id, rc.cache.cache_id, rd.cache.cache_id}) == 4
        assert [r.HasField("output") for r in resp.results] == [True, True, True, False]
        assert resp.kv.active_caches == 4

        ref = local.unified_decode([
            UnifiedItem((ta,), la.cache.cache_id, len(pa), True, output=LOGITS),
            UnifiedItem(tuple(pc), None, 0, True, output=LOGITS),
            UnifiedItem((tb,), lb.cache.cache_id, len(pb_), True, output=LOGITS),
            UnifiedItem(tuple(pd[:16]), None, 0, False, output=LOGITS),
        ])
        local_ids += [ref[1].cache.cache_id, ref[3].cache.cache_id]
        assert ref[3].output is None
        for got, want in zip((ra, rc, rb), (ref[0], ref[1], ref[2])):
            assert got.output.tokens[0].token_id == want.output.tokens[0].token_id
            np.testing.assert_allclose(logits_of(got.output), want.output.logits.numpy(), **F32_TOL)
        # Batch-independence: each row equals its sequence run alone.
        alone = local.prefill(pc, output=LOGITS)
        local_ids.append(alone.cache.cache_id)
        np.testing.assert_allclose(logits_of(rc.output), alone.output.logits.numpy(), rtol=1e-4, atol=1e-4)

        # D's last chunk completes it, like the whole prompt at once.
        (rd2,) = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(
            cache_id=rd.cache.cache_id, token_ids=pd[16:], pos_offset=16, is_final_chunk=True,
            output=WITH_LOGITS)])).results
        whole = local.prefill(pd, output=LOGITS)
        local_ids.append(whole.cache.cache_id)
        assert rd2.cache.seq_len == len(pd) and rd2.output.tokens[0].token_id == whole.output.tokens[0].token_id
        np.testing.assert_allclose(logits_of(rd2.output), whole.output.logits.numpy(), rtol=1e-4, atol=1e-4)
    finally:
        assert release(stub, *grpc_ids).released == len(grpc_ids)
        local.release_cache(local_ids)


# --------------------------------------------------------------------------------------------- Decode
def test_decode_single_and_multi_step(stub, local):
    prompt = prompt_of(13, seed=8)
    steps = 8
    ref_cid, ref_tokens, ref_logits = greedy_run(local, prompt, steps + 1)  # prefill token + 8 decodes
    local.release_cache([ref_cid])
    single = stub.Prefill(pb.PrefillRequest(token_ids=prompt))
    multi = stub.Prefill(pb.PrefillRequest(token_ids=prompt))
    try:
        first = single.output.tokens[0].token_id
        assert first == multi.output.tokens[0].token_id == ref_tokens[0]
        # 8 single steps, one RPC each.
        tokens, logprobs, rows, token = [], [], [], first
        for k in range(steps):
            resp = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(
                cache=pb.CacheRef(cache_id=single.cache.cache_id, seq_len=len(prompt) + k), token_id=token,
                output=WITH_LOGITS)]))
            (r,) = resp.results
            assert r.cache.seq_len == len(prompt) + k + 1 and len(r.output.tokens) == 1
            token = r.output.tokens[0].token_id
            tokens.append(token)
            logprobs.append(r.output.tokens[0].logprob)
            rows.append(logits_of(r.output)[0])
        assert tokens == ref_tokens[1:]
        np.testing.assert_allclose(np.stack(rows), torch.stack(ref_logits[1:]).numpy(), **F32_TOL)
        # The same 8 steps in one RPC: token for token, logits one row per step.
        (m,) = stub.Decode(pb.DecodeRequest(num_steps=steps, items=[pb.DecodeItem(
            cache=pb.CacheRef(cache_id=multi.cache.cache_id, seq_len=len(prompt)), token_id=first,
            output=WITH_LOGITS)])).results
        assert [t.token_id for t in m.output.tokens] == tokens
        assert [t.logprob for t in m.output.tokens] == pytest.approx(logprobs, abs=1e-5)
        assert logits_of(m.output).shape == (steps, VOCAB)
        np.testing.assert_allclose(logits_of(m.output), np.stack(rows), **F32_TOL)
        assert m.cache.seq_len == len(prompt) + steps
    finally:
        release(stub, single.cache.cache_id, multi.cache.cache_id)


def test_multi_step_decode_stops_at_stop_token(stub, local):
    prompt = prompt_of(13, seed=8)
    ref_cid, ref_tokens, _ = greedy_run(local, prompt, 9)
    local.release_cache([ref_cid])
    stop = ref_tokens[4]  # the 4th decoded token
    k = ref_tokens[1:].index(stop)  # its first occurrence among the decoded tokens
    res = stub.Prefill(pb.PrefillRequest(token_ids=prompt))
    try:
        (d,) = stub.Decode(pb.DecodeRequest(num_steps=8, items=[pb.DecodeItem(
            cache=pb.CacheRef(cache_id=res.cache.cache_id, seq_len=len(prompt)), token_id=ref_tokens[0],
            stop_token_ids=[stop, VOCAB - 1])])).results
        assert [t.token_id for t in d.output.tokens] == ref_tokens[1:k + 2]  # the stop token is returned
        assert d.output.tokens[-1].token_id == stop and len(d.output.tokens) < 8
        assert d.cache.seq_len == len(prompt) + k + 1  # one token written per step taken
    finally:
        release(stub, res.cache.cache_id)


def test_multi_item_decode_with_per_item_logits_dtype(stub, local):
    """Each item's logits come back in its own dtype, in item order."""
    prompts = [prompt_of(6, 9), prompt_of(19, 10)]
    caches = [stub.Prefill(pb.PrefillRequest(token_ids=p)) for p in prompts]
    refs = [local.prefill(p) for p in prompts]
    try:
        dtypes = [pb.LOGITS_DTYPE_FLOAT16, pb.LOGITS_DTYPE_FLOAT32]
        resp = stub.Decode(pb.DecodeRequest(num_steps=3, items=[
            pb.DecodeItem(cache=pb.CacheRef(cache_id=c.cache.cache_id, seq_len=len(p)),
                          token_id=c.output.tokens[0].token_id,
                          output=pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS, logits_dtype=dt))
            for c, p, dt in zip(caches, prompts, dtypes)]))
        ref = local.decode([DecodeItem(CacheRef(r.cache.cache_id, len(p)), r.output.tokens[0].token_id, output=LOGITS)
                            for r, p in zip(refs, prompts)], num_steps=3)
        for got, want, dt in zip(resp.results, ref, dtypes):
            assert got.output.logits.dtype == dt
            assert [t.token_id for t in got.output.tokens] == [t.token_id for t in want.output.tokens]
            tol = dict(rtol=1e-3, atol=1e-3) if dt == pb.LOGITS_DTYPE_FLOAT16 else F32_TOL
            np.testing.assert_allclose(logits_of(got.output), want.output.logits.numpy(), **tol)
    finally:
        release(stub, *(c.cache.cache_id for c in caches))
        local.release_cache([r.cache.cache_id for r in refs])


# ------------------------------------------------------------------------- ForwardVerify + TruncateCache
def test_forward_verify_then_truncate(stub, local):
    prompt = prompt_of(14, seed=11)
    n = len(prompt)
    ref_cid, g, ref_logits = greedy_run(local, prompt, 5)  # g[0] from prefill, g[1..4] decoded
    local.release_cache([ref_cid])
    wrong = (g[2] + 1) % VOCAB
    res = stub.Prefill(pb.PrefillRequest(token_ids=prompt))
    cid = res.cache.cache_id
    lres = local.prefill(prompt)
    try:
        assert res.output.tokens[0].token_id == g[0]
        drafts = [g[0], g[1], wrong, 5]  # the last accepted token, one right draft, one wrong, one more
        v = stub.ForwardVerify(pb.ForwardVerifyRequest(cache=pb.CacheRef(cache_id=cid, seq_len=n),
                                                       token_ids=drafts, output=WITH_LOGITS))
        assert (v.cache.cache_id, v.cache.seq_len) == (cid, n + 4)
        assert len(v.positions) == 4 and v.kv.free_blocks == KV_BLOCKS - 2  # 18 tokens: 2 blocks
        assert [p.tokens[0].token_id for p in v.positions[:2]] == [g[1], g[2]]
        np.testing.assert_allclose(logits_of(v.positions[0])[0], ref_logits[1].numpy(), **OTHER_PATH_TOL)
        np.testing.assert_allclose(logits_of(v.positions[1])[0], ref_logits[2].numpy(), **OTHER_PATH_TOL)
        ref_v = local.forward_verify(CacheRef(lres.cache.cache_id, n), drafts, output=LOGITS)
        for got, want in zip(v.positions, ref_v.positions):
            assert got.tokens[0].token_id == want.tokens[0].token_id
            np.testing.assert_allclose(logits_of(got), want.logits.numpy(), **F32_TOL)

        # Keep prompt + g0 + g1 (the wrong draft is rejected): whole blocks past 16 tokens are freed.
        t = stub.TruncateCache(pb.TruncateCacheRequest(cache_id=cid, new_len=n + 2))
        assert (t.cache.cache_id, t.cache.seq_len) == (cid, n + 2) and t.kv.free_blocks == KV_BLOCKS - 1
        # Decoding continues from the truncated cache exactly like the plain greedy run.
        (d,) = stub.Decode(pb.DecodeRequest(num_steps=2, items=[pb.DecodeItem(
            cache=pb.CacheRef(cache_id=cid, seq_len=n + 2), token_id=g[2], output=WITH_LOGITS)])).results
        assert [tok.token_id for tok in d.output.tokens] == g[3:5]
        np.testing.assert_allclose(logits_of(d.output), torch.stack(ref_logits[3:5]).numpy(), **OTHER_PATH_TOL)
        # Truncating to 0 keeps no block; the cache id stays valid and restarts at position 0.
        t0 = stub.TruncateCache(pb.TruncateCacheRequest(cache_id=cid, new_len=0))
        assert t0.cache.seq_len == 0 and t0.kv.free_blocks == KV_BLOCKS and t0.kv.active_caches == 1
        (u,) = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(
            cache_id=cid, token_ids=prompt, pos_offset=0, is_final_chunk=True)])).results
        assert u.cache.seq_len == n and u.output.tokens[0].token_id == g[0]
    finally:
        release(stub, cid)
        local.release_cache([lres.cache.cache_id])


def test_forward_verify_logits_only(stub, local):
    prompt = prompt_of(5, seed=12)
    res = stub.Prefill(pb.PrefillRequest(token_ids=prompt))
    try:
        v = stub.ForwardVerify(pb.ForwardVerifyRequest(
            cache=pb.CacheRef(cache_id=res.cache.cache_id, seq_len=5), token_ids=[7, 8, 9],
            output=pb.OutputOptions(mode=pb.OUTPUT_MODE_LOGITS)))
        assert len(v.positions) == 3
        for p in v.positions:
            assert len(p.tokens) == 0 and logits_of(p).shape == (1, VOCAB)
    finally:
        release(stub, res.cache.cache_id)


# ---------------------------------------------------------------------------------------- ReleaseCache
def test_release_cache_is_idempotent(stub):
    a = stub.Prefill(pb.PrefillRequest(token_ids=prompt_of(20, 13)))
    b = stub.Prefill(pb.PrefillRequest(token_ids=prompt_of(3, 14)))
    assert b.kv.free_blocks == KV_BLOCKS - 3 and b.kv.active_caches == 2
    a_id, b_id = a.cache.cache_id, b.cache.cache_id
    r = release(stub, a_id, b_id, a_id, "f" * 32)
    assert r.released == 2 and list(r.unknown_cache_ids) == [a_id, "f" * 32]
    assert (r.kv.free_blocks, r.kv.total_blocks, r.kv.active_caches) == (KV_BLOCKS, KV_BLOCKS, 0)
    again = release(stub, a_id, b_id)
    assert again.released == 0 and list(again.unknown_cache_ids) == [a_id, b_id]
    empty = release(stub)
    assert empty.released == 0 and list(empty.unknown_cache_ids) == []
    assert empty.kv.free_blocks == KV_BLOCKS
    (gone,) = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=pb.CacheRef(cache_id=a_id, seq_len=20),
                                                                token_id=3)])).results
    assert gone.status.code == grpc.StatusCode.NOT_FOUND.value[0]  # a released cache is gone (the item's status)


# ------------------------------------------------------------------------------------------ GetMetrics
def test_get_metrics_counts_grow(stub):
    before = stub.GetMetrics(pb.GetMetricsRequest())
    prompt = prompt_of(10, 15)
    res = stub.Prefill(pb.PrefillRequest(token_ids=prompt))
    stub.Decode(pb.DecodeRequest(num_steps=3, items=[pb.DecodeItem(
        cache=pb.CacheRef(cache_id=res.cache.cache_id, seq_len=10), token_id=res.output.tokens[0].token_id)]))
    release(stub, res.cache.cache_id)
    after = stub.GetMetrics(pb.GetMetricsRequest())
    assert after.forward_passes == before.forward_passes + 4  # 1 prefill + 3 decode steps
    assert after.tokens_processed == before.tokens_processed + 10 + 3
    assert after.tokens_sampled == before.tokens_sampled + 4
    assert after.caches_created == before.caches_created + 1
    assert after.caches_released == before.caches_released + 1
    for op in ("prefill", "decode", "release_cache"):
        assert after.operations[op].count == (before.operations[op].count if op in before.operations else 0) + 1
    for method in ("Prefill", "Decode", "ReleaseCache", "GetMetrics"):
        assert method in after.rpcs, sorted(after.rpcs)
        s = after.rpcs[method]
        assert s.count >= 1 and 0 <= s.p95_ms <= s.max_ms and s.mean_ms <= s.max_ms
    def rpc_count(m: pb.GetMetricsResponse, method: str) -> int:
        return m.rpcs[method].count if method in m.rpcs else 0  # (indexing a missing key would insert it)

    for method in ("Prefill", "Decode", "ReleaseCache", "GetMetrics"):  # GetMetrics: `before` itself
        assert rpc_count(after, method) == rpc_count(before, method) + 1, method
    assert after.lock_wait.count > before.lock_wait.count
    assert (after.kv.free_blocks, after.kv.active_caches) == (KV_BLOCKS, 0)


# ----------------------------------------------------------------------------------- logits encodings
@pytest.mark.parametrize("dtype, width, tol", [
    (pb.LOGITS_DTYPE_UNSPECIFIED, 4, F32_TOL),
    (pb.LOGITS_DTYPE_FLOAT32, 4, F32_TOL),
    (pb.LOGITS_DTYPE_BFLOAT16, 2, dict(rtol=1e-2, atol=1e-2)),  # 8 significant bits: 2^-8 relative
    (pb.LOGITS_DTYPE_FLOAT16, 2, dict(rtol=1e-3, atol=1e-3)),  # 11 significant bits
], ids=["unspecified", "float32", "bfloat16", "float16"])
def test_logits_dtypes(stub, local, dtype, width, tol):
    prompt = prompt_of(12, 16)
    ref = local.prefill(prompt, output=LOGITS)
    res = stub.Prefill(pb.PrefillRequest(token_ids=prompt, output=pb.OutputOptions(
        mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS, logits_dtype=dtype)))
    try:
        logits = res.output.logits
        assert logits.dtype == (dtype or pb.LOGITS_DTYPE_FLOAT32)  # unset comes back as float32
        assert logits.vocab_size == VOCAB and len(logits.data) == VOCAB * width
        got = codec.decode_logits(logits)
        want = ref.output.logits.numpy()
        assert got.shape == (1, VOCAB) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, **tol)
        if dtype == pb.LOGITS_DTYPE_BFLOAT16:  # exactly torch's round-to-nearest bf16 of the float32 row
            expect = ref.output.logits.to(torch.bfloat16).float().numpy()
            assert np.mean(got == expect) > 0.99
        assert res.output.tokens[0].token_id == ref.output.tokens[0].token_id  # sampled from float32 logits
    finally:
        release(stub, res.cache.cache_id)
        local.release_cache([ref.cache.cache_id])


def test_logits_mode_returns_no_tokens(stub, local):
    prompt = prompt_of(9, 17)
    ref = local.prefill(prompt, output=LOGITS)
    logits_only = pb.OutputOptions(mode=pb.OUTPUT_MODE_LOGITS, top_logprobs=3)
    res = stub.Prefill(pb.PrefillRequest(token_ids=prompt, output=logits_only))
    try:
        assert len(res.output.tokens) == 0 and res.cache.seq_len == 9
        np.testing.assert_allclose(logits_of(res.output), ref.output.logits.numpy(), **F32_TOL)
        token = ref.output.tokens[0].token_id
        (d,) = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(
            cache=pb.CacheRef(cache_id=res.cache.cache_id, seq_len=9), token_id=token, output=logits_only)])).results
        assert len(d.output.tokens) == 0 and logits_of(d.output).shape == (1, VOCAB) and d.cache.seq_len == 10
        (u,) = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(
            cache_id=res.cache.cache_id, token_ids=[5], pos_offset=10, is_final_chunk=True,
            output=logits_only)])).results
        assert u.HasField("output") and len(u.output.tokens) == 0 and u.output.HasField("logits")
        plain = stub.Prefill(pb.PrefillRequest(token_ids=prompt))  # default mode: tokens, no logits
        release(stub, plain.cache.cache_id)
        assert len(plain.output.tokens) == 1 and not plain.output.HasField("logits")
    finally:
        release(stub, res.cache.cache_id)
        local.release_cache([ref.cache.cache_id])


# ----------------------------------------------------------------------------------- seeded sampling
def test_seeded_sampling_repeats_exactly(stub, local):
    prompt = prompt_of(8, 18)
    sampling = cpb.SamplingParams(temperature=1.3, top_k=50, top_p=0.95, seed=1234)

    def run(seed_sampling: cpb.SamplingParams) -> list[int]:
        res = stub.Prefill(pb.PrefillRequest(token_ids=prompt, sampling=seed_sampling))
        try:
            first = res.output.tokens[0].token_id
            (d,) = stub.Decode(pb.DecodeRequest(num_steps=16, items=[pb.DecodeItem(
                cache=pb.CacheRef(cache_id=res.cache.cache_id, seq_len=len(prompt)), token_id=first,
                sampling=seed_sampling)])).results
            return [first] + [t.token_id for t in d.output.tokens]
        finally:
            release(stub, res.cache.cache_id)

    first, second = run(sampling), run(sampling)
    assert first == second and len(first) == 17
    # ...and equal to the in-process executor with the same seed (the draw depends on seed and position only).
    params = SamplingParams(temperature=1.3, top_k=50, top_p=0.95, seed=1234)
    lres = local.prefill(prompt, sampling=params)
    (ld,) = local.decode([DecodeItem(CacheRef(lres.cache.cache_id, len(prompt)), lres.output.tokens[0].token_id,
                                     sampling=params)], num_steps=16)
    local.release_cache([lres.cache.cache_id])
    assert first == [lres.output.tokens[0].token_id] + [t.token_id for t in ld.output.tokens]
    other = run(cpb.SamplingParams(temperature=1.3, top_k=50, top_p=0.95, seed=4321))
    assert other != first  # a different seed draws differently (fixed seeds: deterministic, not flaky)


# ------------------------------------------------------------------------------- health + reflection
def test_health_serving(server):
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", SERVICE):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_service(server):
    db = ProtoReflectionDescriptorDatabase(server.channel)
    services = set(db.get_services())
    assert {SERVICE, "grpc.health.v1.Health"} <= services
    from google.protobuf.descriptor_pool import DescriptorPool
    desc = DescriptorPool(db).FindServiceByName(SERVICE)
    assert {m.name for m in desc.methods} == {"GetInfo", "Prefill", "Decode", "UnifiedDecode", "ForwardVerify",
                                              "TruncateCache", "ReleaseCache", "GetMetrics", "LoadAdapter",
                                              "UnloadAdapter", "ListAdapters", "OpenSession", "KeepAlive",
                                              "CloseSession", "ListCaches", "CreateCache", "SubscribeKvEvents",
                                              "ExportKv", "ImportKv"}
    assert desc.methods_by_name["Prefill"].input_type.full_name == "tandem.executor.v1.PrefillRequest"


# ------------------------------------------------------------------------------------------- SIGTERM
def test_sigterm_lets_the_in_flight_rpc_finish(model_dir):
    """SIGTERM while a long Decode runs: health turns NOT_SERVING, new RPCs get UNAVAILABLE, the in-flight
    Decode still completes OK with all its steps, and the process exits 0.

    No sleeps: the Decode (6 caches x 200 steps) is known to be in progress once GetMetrics shows its
    forward passes growing while its future is not done; only then is SIGTERM sent. A Decode already
    inside the executor must finish (the servicer must not turn it into UNAVAILABLE afterwards). The health
    Watch stream tells us when the drain has begun, so the refusal check does not race the signal."""
    server = start_executor(model_dir, "--kv-blocks", "128")
    try:
        stub = server.stub
        health = health_pb2_grpc.HealthStub(server.channel)
        items, prompts = [], [prompt_of(8 + i, 30 + i) for i in range(6)]
        for p in prompts:
            res = stub.Prefill(pb.PrefillRequest(token_ids=p))
            items.append(pb.DecodeItem(cache=pb.CacheRef(cache_id=res.cache.cache_id, seq_len=len(p)),
                                       token_id=res.output.tokens[0].token_id))
        steps = 200
        baseline = stub.GetMetrics(pb.GetMetricsRequest()).forward_passes
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        future = stub.Decode.future(pb.DecodeRequest(items=items, num_steps=steps))
        in_flight = False
        while not future.done():  # busy-poll a condition (not a sleep): the decode has taken a step
            if stub.GetMetrics(pb.GetMetricsRequest()).forward_passes > baseline:
                in_flight = not future.done()
                break
        if not in_flight:
            pytest.fail("the Decode finished before it was seen in progress; make it longer")
        server.send_sigterm()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # drain has begun
        watch.cancel()  # an open Watch would otherwise hold the server's grace period
        with pytest.raises(grpc.RpcError) as err:
            stub.GetInfo(pb.GetInfoRequest())
        # UNAVAILABLE from the draining servicer; but once server.stop() has begun, gRPC core itself
        # cancels calls that still arrive on the open connection: the client then sees CANCELLED. Which
        # one we get depends on how far the shutdown got, so both are accepted (never INTERNAL or OK).
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err.value.details()
        try:
            resp = future.result(timeout=60)
        except grpc.RpcError as exc:
            pytest.fail(f"the in-flight Decode failed with {exc.code()}: {exc.details()}\n{server.stderr()}")
        assert len(resp.results) == len(items)
        for r, p in zip(resp.results, prompts):
            assert len(r.output.tokens) == steps  # every step: 8..13 + 200 stays under the 256 limit
            assert r.cache.seq_len == len(p) + len(r.output.tokens)
        assert server.wait_exit() == 0, server.stderr()
    finally:
        server.close()
