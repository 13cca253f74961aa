"""KV migration of a request that shows an image (issue 48 item 4), with real processes on the tiny Qwen2.5-VL
checkpoint: a prefill executor and a decode executor under one scheduler, so the image request's cache moves
(ImportKv, the scheduler's migration path) after its prompt — chunks of 16 tokens, the image's over several —
and the decode executor goes on at the M-RoPE positions the image's grid gives. The request streams transformers'
greedy tokens; the move is counted, no transfer fails and no token is computed again. A text request beside it
moves too. And live migration: an executor told to stop (SIGTERM) while it decodes an image request hands it, KV
and grid, to the other executor, and the stream ends with the tokens of an undisturbed run."""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from tandem.generate.v1 import generate_pb2 as gpb
from tests.e2e.test_kv_migration import KV, _counters, _free_port, _rest, _sampled
from tests.grpc_harness import start_executor, start_for, start_scheduler_for
from tests.qwen_vl_checkpoint import qwen_vl_checkpoint
from tests.scheduler_client import collect, ids_request, wait_kv_free
from tests.vision_checkpoints import noise_image, png_bytes
from tests.vision_greedy import TEXT, qwen2_5_vl_greedy

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return qwen_vl_checkpoint(tmp_path_factory)


def _pictured(image, new_tokens: int) -> gpb.GenerateRequest:
    parts = [gpb.ContentPart(image=gpb.ImageSource(data=png_bytes(image))), gpb.ContentPart(text=TEXT)]
    return gpb.GenerateRequest(messages=gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", parts=parts)]),
                               stopping=gpb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))


def test_an_image_request_moves_to_the_decode_executor_and_streams_the_same_tokens(request, ckpt):
    prefill = start_for(request, ckpt, "--role", "prefill", *KV)
    decode = start_for(request, ckpt, "--role", "decode", *KV)
    scheduler = start_scheduler_for(request, prefill.address, "--executor", decode.address, "--metrics-port", "0",
                                    "--prefill-chunk", "16")
    image = noise_image(50, 70, seed=31)
    _, _, want = qwen2_5_vl_greedy(ckpt, image, NEW_TOKENS)
    pictured = _pictured(image, NEW_TOKENS)
    text = ids_request([1] + [(7 + 13 * k) % 300 + 3 for k in range(40)], 0, stopping=pictured.stopping)
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


def test_a_drained_executors_image_stream_moves_with_its_kv(request, ckpt):
    port = _free_port()
    a = start_executor(ckpt, "--port", str(port), *KV)
    request.addfinalizer(lambda: a.close() if a.proc.poll() is None else None)
    b = start_for(request, ckpt, *KV)
    pictured = _pictured(noise_image(60, 40, seed=32), 96)  # long enough to be decoding when A drains
    # The undisturbed run, on A alone: it also leaves the prompt cached on A, so the pair's router sends it there
    clean = list(collect(start_scheduler_for(request, f"127.0.0.1:{port}").stub, pictured).token_ids)
    scheduler = start_scheduler_for(request, a.address, "--executor", b.address, "--metrics-port", "0")
    before = _counters(scheduler)
    on_a = _sampled(a)
    call = scheduler.stub.Generate(pictured, timeout=120)
    first = next(call)
    assert _sampled(a) > on_a, "the image request does not run on A"
    a.send_sigterm()
    assert a.wait_exit() == 0, a.stderr()
    assert _rest(call, first) == clean
    after = _counters(scheduler)
    assert after["tandem:requests_migrated_total"] - before["tandem:requests_migrated_total"] == 1
    for name in ("tandem:kv_transfer_failures_total", "tandem:tokens_recomputed_total"):
        assert after[name] == before[name], name
    wait_kv_free(b.stub)
