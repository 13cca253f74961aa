"""KV migration of a request that shows an image (issue 48 item 4), with real processes on the tiny Qwen2.5-VL
checkpoint: a prefill executor and a decode executor under one scheduler, so the image request's cache moves
(ImportKv, the scheduler's migration path) after its prompt — chunks of 16 tokens, the image's over several —
and the decode executor goes on at the M-RoPE positions the image's grid gives. The request streams transformers'
greedy tokens; the move is counted, no transfer fails and no token is computed again. A text request beside it
moves too."""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from tandem.generate.v1 import generate_pb2 as gpb
from tests.e2e.test_kv_migration import KV, _counters, _sampled
from tests.grpc_harness import start_for, start_scheduler_for
from tests.qwen_vl_checkpoint import qwen_vl_checkpoint
from tests.scheduler_client import collect, ids_request, wait_kv_free
from tests.vision_checkpoints import noise_image, png_bytes
from tests.vision_greedy import TEXT, qwen2_5_vl_greedy

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return qwen_vl_checkpoint(tmp_path_factory)


def test_an_image_request_moves_to_the_decode_executor_and_streams_the_same_tokens(request, ckpt):
    prefill = start_for(request, ckpt, "--role", "prefill", *KV)
    decode = start_for(request, ckpt, "--role", "decode", *KV)
    scheduler = start_scheduler_for(request, prefill.address, "--executor", decode.address, "--metrics-port", "0",
                                    "--prefill-chunk", "16")
    image = noise_image(50, 70, seed=31)
    _, _, want = qwen2_5_vl_greedy(ckpt, image, NEW_TOKENS)
    stop = gpb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    parts = [gpb.ContentPart(image=gpb.ImageSource(data=png_bytes(image))), gpb.ContentPart(text=TEXT)]
    pictured = gpb.GenerateRequest(messages=gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", parts=parts)]),
                                   stopping=stop)
    text = ids_request([1] + [(7 + 13 * k) % 300 + 3 for k in range(40)], 0, stopping=stop)
    before = (_sampled(prefill), _sampled(decode), _counters(scheduler))
    with cf.ThreadPoolExecutor(2) as pool:
        got, _ = pool.map(lambda r: collect(scheduler.stub, r), [pictured, text])
    assert list(got.token_ids) == want
    after = _counters(scheduler)
    assert _sampled(prefill) - before[0] == 2  # each prompt's token there, every other one after the move
    assert _sampled(decode) - before[1] == 2 * (NEW_TOKENS - 1)
    moved = after["tandem:requests_migrated_total"] - before[2]["tandem:requests_migrated_total"]
    assert moved == 2
    for name in ("tandem:kv_transfer_failures_total", "tandem:tokens_recomputed_total"):
        assert after[name] == before[2][name], name
    wait_kv_free(prefill.stub)
    wait_kv_free(decode.stub)
