"""The default model through the full stack (executor + scheduler subprocesses): it knows the capital of
France, and its greedy chat answers equal transformers' greedy `generate` on the same weights."""
from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect, wait_kv_free

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write one sentence about the sea."]
MAX_NEW = 24


@pytest.fixture(scope="module")
def stack(request, smollm2_dir):
    executor = start_for(request, smollm2_dir, "--kv-blocks", "128")
    return executor, start_scheduler_for(request, executor.address)


def chat(question: str, max_new: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=question)]),
                              stopping=pb.StoppingCriteria(max_new_tokens=max_new))


def test_the_default_model_knows_paris(stack):
    _, scheduler = stack
    got = collect(scheduler.stub, chat("What is the capital of France?", 40))
    assert "Paris" in got.text, got.text
    assert got.finish_reason == pb.FINISH_REASON_STOP  # it ends its turn with <|im_end|>


def test_concurrent_chat_answers_equal_transformers_generate(stack, smollm2_dir):
    executor, scheduler = stack
    with cf.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        results = list(pool.map(lambda q: collect(scheduler.stub, chat(q, MAX_NEW)), QUESTIONS))
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for question, got in zip(QUESTIONS, results):
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=MAX_NEW, do_sample=False)
        want = out[0, len(ids):].tolist()
        assert got.token_ids == want, (question, got.text, tok.decode(want))
        assert got.text == tok.decode(want, skip_special_tokens=True)
    wait_kv_free(executor.stub)
