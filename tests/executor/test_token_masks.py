"""Token masks (UnifiedItem.allowed_tokens) on the executor: applied before every other sampling step
(bias, penalties, temperature, filters), logprobs and returned logits raw; a mask of the wrong length, one that
allows nothing, or one on a chunk that samples nothing fails its item alone with INVALID_ARGUMENT. Through the
in-process client, i.e. the gRPC codec and per-item statuses the gRPC server uses."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from executor_service.rpc.codec import decode_logits
from executor_service.in_process_client import InProcessExecutorClient
from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as pb
from tandem.token_mask import mask_bytes, pack
from tests.executor_driver import make_executor

PROMPT = [5, 6, 7, 8, 9, 10, 11]
WITH_LOGITS = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS, top_logprobs=3)


@pytest.fixture(scope="module")
def client(model_dir):
    return InProcessExecutorClient(make_executor(model_dir, kv_blocks=64))


@pytest.fixture(scope="module")
def raw(client):
    """The prompt's next-token logits without a mask: [vocab] float32."""
    resp = client.unified_decode_now([pb.UnifiedItem(token_ids=PROMPT, is_final_chunk=True, output=WITH_LOGITS)])
    client.release_now([resp.results[0].cache.cache_id])
    return torch.from_numpy(decode_logits(resp.results[0].output.logits).copy())[0]


def vocab(client) -> int:
    return client.info_now().vocab_size


def run(client, *items: pb.UnifiedItem) -> list[pb.UnifiedResult]:
    resp = client.unified_decode_now(list(items))
    client.release_now([r.cache.cache_id for r in resp.results if r.cache.cache_id])
    return list(resp.results)


def item(mask: bytes | None = None, sampling: cpb.SamplingParams | None = None, **kw) -> pb.UnifiedItem:
    return pb.UnifiedItem(token_ids=kw.pop("token_ids", PROMPT), is_final_chunk=kw.pop("is_final_chunk", True),
                          allowed_tokens=mask or b"", sampling=sampling, output=kw.pop("output", WITH_LOGITS), **kw)


def test_greedy_picks_the_best_allowed_token_and_reports_raw_logprobs_and_logits(client, raw):
    v = vocab(client)
    order = raw.argsort(descending=True).tolist()
    allowed = [order[7], order[40], order[100]]  # not the model's favourite
    (res,) = run(client, item(pack(allowed, v)))
    assert res.status.code == 0, res.status.message
    tok = res.output.tokens[0]
    assert tok.token_id == order[7]  # the best of the allowed ones
    lp = torch.log_softmax(raw, -1)
    assert tok.logprob == pytest.approx(float(lp[order[7]]), abs=1e-5)  # the raw distribution's
    assert [a.token_id for a in tok.top_logprobs] == order[:3]  # raw top alternatives, disallowed ones included
    got_logits = torch.from_numpy(decode_logits(res.output.logits).copy())[0]
    assert torch.allclose(got_logits, raw, atol=1e-5)  # returned logits are raw: no -inf


def test_the_mask_comes_before_bias_penalties_and_temperature(client, raw):
    v = vocab(client)
    order = raw.argsort(descending=True).tolist()
    allowed = [order[20], order[30]]
    # A huge bias on a disallowed token, a repetition penalty on the allowed favourite, top-k 1: the mask
    # still decides (bias cannot revive a masked token), then the other stages run on what it left.
    banned = order[0]
    bias = cpb.SamplingParams(logit_bias={banned: 100.0, order[30]: 50.0})
    (res,) = run(client, item(pack(allowed, v), bias))
    assert res.output.tokens[0].token_id == order[30]  # the bias applied after the mask, among the allowed
    top1 = cpb.SamplingParams(temperature=1.0, top_k=1, seed=7, logit_bias={banned: 100.0})
    (res,) = run(client, item(pack(allowed, v), top1))
    assert res.output.tokens[0].token_id == order[20]  # top-k over the masked logits: the best allowed
    hot = [pack(allowed, v)] * 12
    results = run(client, *[item(m, cpb.SamplingParams(temperature=5.0, seed=s, repetition_penalty=2.0,
                                                       logit_bias={banned: 100.0}))
                            for s, m in enumerate(hot)])
    sampled = {r.output.tokens[0].token_id for r in results}
    assert sampled <= set(allowed) and len(sampled) == 2, sampled  # hot sampling: both allowed, nothing else


def test_rows_without_a_mask_are_untouched_in_a_masked_batch(client, raw):
    v = vocab(client)
    order = raw.argsort(descending=True).tolist()
    results = run(client, item(pack([order[9]], v)), item(), item(pack([order[3], order[4]], v)))
    assert [r.output.tokens[0].token_id for r in results] == [order[9], order[0], order[3]]
    assert results[1].output.tokens[0].logprob == pytest.approx(float(torch.log_softmax(raw, -1)[order[0]]),
                                                               abs=1e-5)


def test_bad_masks_fail_their_item_alone(client, raw):
    v = vocab(client)
    good = pack([int(raw.argmax())], v)
    n = mask_bytes(v)
    results = run(client, item(good[:-4]),  # one word short
                  item(good + b"\0\0\0\0"),  # one word long
                  item(b"\0" * n),  # allows nothing
                  item(pack([v + 1], v + 32)[:n] if v % 32 else b"\0" * n),  # only bits past the vocabulary
                  item(good, token_ids=PROMPT[:3], is_final_chunk=False),  # a chunk that samples nothing
                  item(good))  # fine
    codes = [r.status.code for r in results]
    assert codes[:5] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 5 and codes[5] == 0, codes
    assert f"{n - 4} bytes" in results[0].status.message and f"{n} (ceil(vocab_size / 32)" in \
        results[0].status.message
    assert "allows no token" in results[2].status.message and "allows no token" in results[3].status.message
    assert "samples nothing" in results[4].status.message
    assert all(not r.cache.cache_id for r in results[:5])  # nothing was created for the failed items
    assert results[5].output.tokens[0].token_id == int(raw.argmax())


def test_the_executor_lists_the_capability(client):
    assert "token_masks" in client.info_now().capabilities


def test_pack_layout_bit_order():
    mask = pack([0, 31, 32, 100], 128)
    words = np.frombuffer(mask, dtype="<u4")
    assert words.tolist() == [1 | 1 << 31, 1, 0, 1 << 4]  # bit t % 32 of word t // 32


def test_the_device_unpacking_equals_the_host_one(monkeypatch):
    """On a CPU the mask is unpacked with numpy; on an accelerator with torch bit ops on the device: both give
    the same logits (the device branch forced here on the CPU)."""
    from models import sampler as sampler_module
    from models.sampler import Sampler, SamplingRow
    from tandem.sampling_params import SamplingParams
    v = 100
    rows = [SamplingRow(SamplingParams(), [1], 0, 1, 0, pack([0, 7, 8, 31, 32, 99], v)),
            SamplingRow(SamplingParams(), [1], 0, 1), SamplingRow(SamplingParams(), [1], 0, 1, 0, pack([50], v))]
    logits = torch.randn(3, 104)
    host = Sampler(v).process_logits(logits, rows)
    monkeypatch.setattr(sampler_module, "_on_host", lambda t: False)
    device = Sampler(v).process_logits(logits, rows)
    assert torch.equal(host, device)
    assert torch.isfinite(host[0]).nonzero().flatten().tolist() == [0, 7, 8, 31, 32, 99]
    assert torch.isfinite(host[1]).all() and torch.isfinite(host[2]).nonzero().flatten().tolist() == [50]
