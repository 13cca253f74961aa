"""Prompt logprobs through the whole stack (real executor and scheduler processes, tiny llama): GenerateService's
prompt_logprobs (first message only, equal to transformers' log_softmax within 1e-4, the same again from the
prefix cache with usage.cached_tokens > 0), requests preempted under a small KV pool returning them once and
right, and the OpenAI HTTP front through the real `openai` client: /v1/completions echo with logprobs (the
prompt's tokens first, the first one null; max_tokens 0 returns the prompt alone) and vLLM's prompt_logprobs
extra on completions and chat."""
from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest
import torch

from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.hf_reference import HfReference
from tests.scheduler_client import collect, ids_request, wait_kv_free

TOL = 1e-4
PROMPT = [1] + [3 + (i * 37) % 397 for i in range(52)]  # 53 tokens: 3 full blocks and a bit


@pytest.fixture(scope="module")
def stack(request, model_dir):
    executor = start_for(request, model_dir, "--kv-blocks", "256")
    return executor, start_scheduler_for(request, executor.address, "--http-port", "0")


@pytest.fixture(scope="module")
def ref(model_dir):
    return HfReference(model_dir)


def reference(ref: HfReference, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(ref.all_logits(prompt)[:-1], dim=-1)  # row i: the distribution of prompt[i + 1]


def assert_entries(entries, want: torch.Tensor, prompt: list[int], top: int) -> None:
    assert [e.token_id for e in entries] == prompt[1:]
    for k, e in enumerate(entries):
        row = want[k]
        assert abs(e.logprob - float(row[prompt[k + 1]])) < TOL
        assert e.rank == int((row > row[prompt[k + 1]]).sum()) + 1
        assert [a.token_id for a in e.top_logprobs] == row.topk(top).indices.tolist()


def test_generate_returns_prompt_logprobs_once_and_from_the_prefix_cache(stack, ref):
    _, sch = stack
    want = reference(ref, PROMPT)
    first = collect(sch.stub, ids_request(PROMPT, 3, prompt_logprobs=2))
    assert len(first.messages[0].prompt_logprobs) == len(PROMPT) - 1
    assert all(not m.prompt_logprobs for m in first.messages[1:])
    assert_entries(first.messages[0].prompt_logprobs, want, PROMPT, 2)
    again = collect(sch.stub, ids_request(PROMPT, 3, prompt_logprobs=1))
    assert again.usage.cached_tokens == 48  # 3 blocks served with their stored prompt logprobs
    assert_entries(again.messages[0].prompt_logprobs, want, PROMPT, 1)
    plain = collect(sch.stub, ids_request(PROMPT, 3))
    assert all(not m.prompt_logprobs for m in plain.messages) and plain.token_ids == first.token_ids


def test_preempted_requests_return_them_once_and_right(request, model_dir, ref):
    executor = start_for(request, model_dir, "--kv-blocks", "12")  # 192 tokens for six 70-token sequences
    sch = start_scheduler_for(request, executor.address, "--prefill-chunk", "32", "--speculative", "off")
    prompts = [PROMPT[:20] + [200 + q] + PROMPT[21:] for q in range(6)]
    stop = pb.StoppingCriteria(max_new_tokens=20, ignore_eos=True)
    with cf.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: collect(sch.stub, ids_request(p, 0, stopping=stop, prompt_logprobs=1)), prompts))
    assert sum(g.usage.preemptions for g in got) > 0
    for p, g in zip(prompts, got):
        assert sum(len(m.prompt_logprobs) for m in g.messages) == len(p) - 1  # sent once, in the first message
        assert_entries(g.messages[0].prompt_logprobs, reference(ref, p), p, 1)
    wait_kv_free(executor.stub)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[1].process.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions_echo_with_logprobs(client, ref):
    want = reference(ref, PROMPT)
    out = client.completions.create(model="", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = out.choices[0]
    lp = c.logprobs
    assert c.finish_reason == "length" and out.usage.completion_tokens == 0
    assert len(lp.tokens) == len(PROMPT) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert c.text == "".join(lp.tokens) or c.text  # the prompt's text (decoded ids)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for k in range(1, len(PROMPT)):
        assert abs(lp.token_logprobs[k] - float(want[k - 1][PROMPT[k]])) < TOL
        assert lp.tokens[k] in lp.top_logprobs[k] and len(lp.top_logprobs[k]) <= 2
    one = client.completions.create(model="", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp1 = one.choices[0].logprobs
    assert len(lp1.tokens) == len(PROMPT) + 1 and lp1.token_logprobs[:-1] == lp.token_logprobs  # lm-eval's shape
    text = client.completions.create(model="", prompt="hello there", max_tokens=2, echo=True, temperature=0)
    assert text.choices[0].text.startswith("hello there") and text.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="", prompt=PROMPT, max_tokens=0)


def test_vllm_prompt_logprobs_extra(client, ref):
    want = reference(ref, PROMPT)
    out = client.completions.create(model="", prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT)
    for k in range(1, len(PROMPT)):
        entry = plp[k]
        mine = entry[str(PROMPT[k])]
        assert abs(mine["logprob"] - float(want[k - 1][PROMPT[k]])) < TOL and mine["rank"] >= 1
        ranks = sorted(v["rank"] for t, v in entry.items() if t != str(PROMPT[k]) or mine["rank"] <= 2)
        assert ranks[:2] == [1, 2] and all(isinstance(v["decoded_token"], str) for v in entry.values())
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    top = chat.model_extra["prompt_logprobs"]
    assert top[0] is None and all(len(e) == 1 for e in top[1:])
