"""The whole stack with both servers as real subprocesses (tiny llama checkpoint): greedy text equals
transformers' `generate`, concurrent streams, stop strings across tokens, cancellation and deadlines free
the KV cache, preemption under a small KV pool loses nothing, validation codes, Tokenize, GetModelInfo."""
from __future__ import annotations

import concurrent.futures as cf
import random

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.common.v1 import common_pb2 as cpb

from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import cancel_stream, collect, ids_request, rpc_error, wait_kv_free

MAX_NEW = 24
SMALL_KV_BLOCKS = 12  # x 16 tokens: 192 tokens for everyone


@pytest.fixture(scope="module")
def executor(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", "256")


@pytest.fixture(scope="module")
def scheduler(request, executor):
    return start_scheduler_for(request, executor.address)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def hf_generate(hf, prompt: list[int], max_new: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy generate; its output stops after EOS (included), like ours."""
    kw = {"min_new_tokens": max_new} if ignore_eos else {}
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 400) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def test_greedy_matches_transformers_generate(scheduler, hf, tok):
    for prompt in prompts(4):
        got = collect(scheduler.stub, ids_request(prompt, MAX_NEW))
        want = hf_generate(hf, prompt, MAX_NEW)
        assert got.token_ids == want
        assert got.text == tok.decode(want, skip_special_tokens=True)
        assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == len(want)
        ended_on_eos = want[-1] in (2,) and len(want) <= MAX_NEW
        assert got.finish_reason == (pb.FINISH_REASON_STOP if ended_on_eos else pb.FINISH_REASON_LENGTH)


def test_text_and_chat_inputs_match_transformers(scheduler, hf, tok):
    text = "hello world, the quick brown fox"
    got = collect(scheduler.stub, pb.GenerateRequest(text=text, stopping=pb.StoppingCriteria(max_new_tokens=12)))
    assert got.token_ids == hf_generate(hf, tok(text)["input_ids"], 12)
    messages = [{"role": "user", "content": "hi there"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    chat = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi there")]),
                              stopping=pb.StoppingCriteria(max_new_tokens=12))
    got = collect(scheduler.stub, chat)
    assert got.usage.prompt_tokens == len(ids)
    assert got.token_ids == hf_generate(hf, list(ids), 12)


def test_sixteen_concurrent_streams(scheduler, executor, hf, tok):
    ps = prompts(16, seed=1)
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: collect(scheduler.stub, ids_request(p, MAX_NEW)), ps))
    for p, got in zip(ps, results):
        want = hf_generate(hf, p, MAX_NEW)
        assert got.token_ids == want
        assert got.text == tok.decode(want, skip_special_tokens=True)
    wait_kv_free(executor.stub)


def test_stop_string_split_across_tokens(scheduler, tok):
    prompt = prompts(1, seed=2)[0]
    full = collect(scheduler.stub, ids_request(prompt, 40, stopping=pb.StoppingCriteria(max_new_tokens=40,
                                                                                          ignore_eos=True)))
    pieces = [tok.decode([t]) for t in full.token_ids]
    # a stop string made of the end of one token and the start of the next (its first occurrence)
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1)
    stop = pieces[k][-2:] + pieces[k + 1][:1]
    at = full.text.find(stop)
    assert at >= 0
    req = ids_request(prompt, 40, stopping=pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True, stop=[stop]))
    got = collect(scheduler.stub, req)
    assert got.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and got.stop_reason == stop
    assert got.text == full.text[:at]
    inclusive = ids_request(prompt, 40, stopping=pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True, stop=[stop],
                                                                     include_stop_str_in_output=True))
    assert collect(scheduler.stub, inclusive).text == full.text[:at + len(stop)]


def test_stop_token_ids_min_new_tokens_and_ignore_eos(scheduler):
    prompt = prompts(1, seed=3)[0]
    full = collect(scheduler.stub, ids_request(prompt, 30, stopping=pb.StoppingCriteria(max_new_tokens=30,
                                                                                          ignore_eos=True)))
    assert len(full.token_ids) == 30 and full.finish_reason == pb.FINISH_REASON_LENGTH
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    got = collect(scheduler.stub, ids_request(prompt, 30, stopping=pb.StoppingCriteria(
        max_new_tokens=30, ignore_eos=True, stop_token_ids=[target])))
    assert got.token_ids == full.token_ids[:first + 1]
    assert got.finish_reason == pb.FINISH_REASON_STOP and got.stop_reason == str(target)
    later = collect(scheduler.stub, ids_request(prompt, 30, stopping=pb.StoppingCriteria(
        max_new_tokens=30, ignore_eos=True, stop_token_ids=[target], min_new_tokens=first + 2)))
    # transformers' min_new_tokens semantics: the stop token is never sampled before the minimum
    assert target not in later.token_ids[:first + 2] and len(later.token_ids) >= first + 2
    assert later.token_ids[:first] == full.token_ids[:first]


def test_cancelled_stream_frees_its_kv(scheduler, executor):
    call = scheduler.stub.Generate(ids_request(prompts(1, seed=4)[0], 200, stopping=pb.StoppingCriteria(
        max_new_tokens=200, ignore_eos=True)))
    next(call), next(call)
    cancel_stream(call)
    wait_kv_free(executor.stub)
    assert collect(scheduler.stub, ids_request([1, 5, 6], 3)).usage.completion_tokens >= 1  # still serving


@pytest.fixture(scope="module")
def one_step_scheduler(request, executor):
    """One decode step per executor call: 200 tokens take 200 round trips (>= 2 ms each), so a 0.1 s deadline
    always falls mid-generation. With multi-step bursts the tiny model can finish 200 tokens inside 0.1 s on a
    fast machine (CI did), and the test would then check nothing."""
    return start_scheduler_for(request, executor.address, "--decode-burst-ms", "0")


def test_deadline_frees_its_kv(one_step_scheduler, executor):
    req = ids_request(prompts(1, seed=5)[0], 200, stopping=pb.StoppingCriteria(max_new_tokens=200, ignore_eos=True))
    err = rpc_error(lambda: list(one_step_scheduler.stub.Generate(req, timeout=0.1)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_kv_free(executor.stub)


def test_logprobs_and_seeded_sampling(scheduler):
    prompt = prompts(1, seed=6)[0]
    sampling = cpb.SamplingParams(temperature=0.9, top_k=50, seed=1234)
    req = ids_request(prompt, 16, sampling=sampling, top_logprobs=3,
                      stopping=pb.StoppingCriteria(max_new_tokens=16, ignore_eos=True))
    a, b = collect(scheduler.stub, req), collect(scheduler.stub, req)
    assert a.token_ids == b.token_ids and a.text == b.text
    for lp in a.logprobs:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[-1].logprob


@pytest.mark.parametrize("make, code", [
    (lambda: pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda: pb.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999])), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda: ids_request([1, 5], 4, adapter="nope"), grpc.StatusCode.NOT_FOUND),
    (lambda: ids_request([1, 5], 255), grpc.StatusCode.OUT_OF_RANGE),
    (lambda: ids_request([1] * 256, 1), grpc.StatusCode.OUT_OF_RANGE),
    (lambda: ids_request([1, 5], 4, sampling=cpb.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda: ids_request([1, 5], 4, sampling=cpb.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda: ids_request([1, 5], 4, top_logprobs=21), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda: ids_request([1, 5], 4, stopping=pb.StoppingCriteria(max_new_tokens=4, min_new_tokens=5)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (lambda: ids_request([1, 5], 4, stopping=pb.StoppingCriteria(max_new_tokens=4, stop=[""])),
     grpc.StatusCode.INVALID_ARGUMENT),
])
def test_invalid_requests_get_precise_codes(scheduler, executor, make, code):
    err = rpc_error(lambda: list(scheduler.stub.Generate(make(), timeout=30)))
    assert err.code() == code, err.details()
    assert err.details()  # a message a developer can act on
    wait_kv_free(executor.stub)


def test_tokenize_and_model_info(scheduler, tok, model_dir):
    res = scheduler.stub.Tokenize(pb.TokenizeRequest(text="hello world"))
    assert list(res.token_ids) == tok("hello world")["input_ids"]
    assert "".join(res.pieces) == tok.decode(res.token_ids)
    info = scheduler.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_id == model_dir.name and info.vocab_size > 0 and info.max_seq_len == 256
    assert info.has_chat_template and list(info.eos_token_ids) == [2]


# ---------------------------------------------------------------- a small KV pool: preemption


@pytest.fixture(scope="module")
def small_kv(request, model_dir):
    executor = start_for(request, model_dir, "--kv-blocks", str(SMALL_KV_BLOCKS))
    return executor, start_scheduler_for(request, executor.address, "--speculative", "off")  # (preemption, not drafts)


def test_preemption_under_a_small_kv_pool_loses_nothing(small_kv, hf, tok):
    executor, scheduler = small_kv
    ps = prompts(8, seed=7)  # each needs <= 40 + 40 tokens (5 blocks); all together far more than 12 blocks
    stop = pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True)
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: collect(scheduler.stub, ids_request(p, 40, stopping=stop)), ps))
    assert sum(r.usage.preemptions for r in results) > 0, "the pool was meant to be too small for all at once"
    for p, got in zip(ps, results):
        want = hf_generate(hf, p, 40, ignore_eos=True)
        assert got.token_ids == want
        assert got.text == tok.decode(want, skip_special_tokens=True)
    wait_kv_free(executor.stub)


def test_a_request_that_cannot_fit_alone_is_resource_exhausted(small_kv):
    executor, scheduler = small_kv
    err = rpc_error(lambda: list(scheduler.stub.Generate(ids_request([1] * 100, 150))))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV" in err.details()
    wait_kv_free(executor.stub)


def test_preemption_keeps_penalties_on_earlier_outputs(small_kv, scheduler):
    """presence/frequency penalties count output tokens only; a recomputed sequence re-enters its outputs
    as one prefill, with prompt_len telling the executor which of them are outputs."""
    _, small = small_kv
    ps = prompts(8, seed=8)
    sampling = cpb.SamplingParams(presence_penalty=0.7, frequency_penalty=0.9)
    stop = pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True)
    reqs = [ids_request(p, 40, stopping=stop, sampling=sampling) for p in ps]
    alone = [collect(scheduler.stub, r) for r in reqs]
    with cf.ThreadPoolExecutor(8) as pool:
        squeezed = list(pool.map(lambda r: collect(small.stub, r), reqs))
    assert sum(r.usage.preemptions for r in squeezed) > 0
    assert [r.token_ids for r in squeezed] == [r.token_ids for r in alone]


@pytest.fixture(scope="module")
def chunky(request, executor):
    """A second scheduler on the same executor that cuts every prompt into chunks of 7 tokens under a
    budget of 24 tokens per step: chunked prefill mixed with decodes in every step."""
    return start_scheduler_for(request, executor.address, "--prefill-chunk", "7", "--max-batch-tokens", "24",
                               "--max-running", "6")


def test_chunked_prefill_matches_transformers(chunky, scheduler, executor, hf):
    ps = prompts(6, seed=9)
    stop = pb.StoppingCriteria(max_new_tokens=16, ignore_eos=True)
    sampling = cpb.SamplingParams(frequency_penalty=0.5)  # penalties must see the prompt/output split right
    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda p: collect(chunky.stub, ids_request(p, 16, stopping=stop)), ps))
        penalised = list(pool.map(lambda p: collect(chunky.stub, ids_request(p, 16, stopping=stop,
                                                                              sampling=sampling)), ps))
    for p, got in zip(ps, results):
        assert got.token_ids == hf_generate(hf, p, 16, ignore_eos=True)
    for p, got in zip(ps, penalised):  # the same request in one piece (default chunk 512): the same tokens
        whole = collect(scheduler.stub, ids_request(p, 16, stopping=stop, sampling=sampling))
        assert got.token_ids == whole.token_ids
    wait_kv_free(executor.stub)
