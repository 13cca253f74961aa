"""vLLM's request extensions against real processes (tiny executor, scheduler --http-port 0): the real guidellm
0.8.1 (the load generator that found the regression: it streams with stream_options {include_usage,
continuous_usage_stats}, ignore_eos and stop: null) runs a benchmark and every request succeeds; continuous usage
stats as vLLM 0.10.1.1 streams them (every chunk of a choice carries its usage so far, chat and completions,
n > 1); request_id names the response; every other extra of vLLM 0.10.1.1's protocol is accepted where it changes
nothing and otherwise refused, 400 naming the field and why (scheduler/http/vllm_extras.py), never "unknown".
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import openai
import pytest

from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import wait_kv_free

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "hi there"}]
NAME = "tiny"


@pytest.fixture(scope="module")
def stack(request, model_dir):
    executor = start_for(request, model_dir, "--kv-blocks", "128")
    return executor, start_scheduler_for(request, executor.address, "--http-port", "0", "--served-model-name", NAME)


@pytest.fixture(scope="module")
def url(stack) -> str:
    return stack[1].process.http_url


def _sse(url: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("route,base", [("/v1/chat/completions", {"messages": CHAT}),
                                        ("/v1/completions", {"prompt": "hi there"})])
def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(url, stack, route, base):
    body = {**base, "model": NAME, "max_tokens": 6, "n": 2, "seed": 1, "ignore_eos": True, "stop": None,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _sse(url, route, body)
    *per_choice, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12  # (2 choices x 6)
    prompt = last["usage"]["prompt_tokens"]
    seen = {0: 0, 1: 0}
    for c in per_choice:
        (choice,) = c["choices"]
        usage = c["usage"]
        assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"]
        assert usage["completion_tokens"] >= seen[choice["index"]]  # so far, per choice
        seen[choice["index"]] = usage["completion_tokens"]
    assert seen == {0: 6, 1: 6}
    plain = _sse(url, route, {**body, "stream_options": {"include_usage": True}})
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (cached_tokens: the prefix cache's since)
    assert all(c["usage"] is None for c in plain[:-1])
    assert [plain[-1]["usage"][k] for k in counts] == [last["usage"][k] for k in counts]
    wait_kv_free(stack[0].stub)


def test_request_id_names_the_response(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2,
                                          extra_body={"request_id": "run-7"})
    assert chat.id == "chatcmpl-run-7"
    done = client.completions.create(model=NAME, prompt="hi", max_tokens=2, extra_body={"request_id": "run-8"})
    assert done.id == "cmpl-run-8"


# vLLM 0.10.1.1's extras at the value that changes nothing (its defaults, and those served): taken
HARMLESS = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True, "priority": 0,
            "guided_decoding_backend": "guidance", "logits_processors": [], "vllm_xargs": {}, "best_of": 1,
            "bad_words": [], "echo": False, "add_generation_prompt": True, "continue_final_message": False,
            "add_special_tokens": False, "documents": None, "mm_processor_kwargs": None, "include_stop_str_in_output":
            False, "skip_special_tokens": True, "min_tokens": 0, "stop_token_ids": [], "return_tokens_as_token_ids":
            False}
# (route, field, value, what the refusal says)
REFUSED = [
    ("/v1/chat/completions", "use_beam_search", True, "beam search"),
    ("/v1/completions", "use_beam_search", True, "beam search"),
    ("/v1/chat/completions", "length_penalty", 0.5, "beam search"),
    ("/v1/chat/completions", "priority", 1, "first come, first served"),
    ("/v1/completions", "truncate_prompt_tokens", 8, "never cut"),
    ("/v1/chat/completions", "allowed_token_ids", [1, 2], "logit_bias"),
    ("/v1/chat/completions", "bad_words", ["rain"], "not served"),
    ("/v1/chat/completions", "guided_decoding_backend", "xgrammar", "llguidance"),
    ("/v1/completions", "guided_whitespace_pattern", " ", "whitespace"),
    ("/v1/chat/completions", "logits_processors", ["my.Processor"], "no code"),
    ("/v1/completions", "kv_transfer_params", {"do_remote_decode": True}, "KV"),
    ("/v1/chat/completions", "vllm_xargs", {"k": 1}, "plugins"),
    ("/v1/chat/completions", "chat_template", "{{ messages }}", "--chat-template"),
    ("/v1/chat/completions", "add_generation_prompt", False, "generation prompt"),
    ("/v1/chat/completions", "continue_final_message", True, "continuing"),
    ("/v1/chat/completions", "echo", True, "echo"),
    ("/v1/chat/completions", "documents", [{"title": "a", "text": "b"}], "documents"),
    ("/v1/chat/completions", "structural_tag", "{}", "structural tags"),
    ("/v1/chat/completions", "best_of", 2, "best_of equal to n"),
    ("/v1/completions", "add_special_tokens", False, "token ids"),
    ("/v1/completions", "prompt_embeds", "AAAA", "embeddings"),
    ("/v1/chat/completions", "mm_processor_kwargs", {"a": 1}, "text only"),
    ("/v1/chat/completions", "spaces_between_special_tokens", False, None),  # (with skip_special_tokens: false)
]


def test_vllm_extras_are_taken_where_harmless_and_refused_naming_why(url, stack):
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **HARMLESS})
        assert r.status_code == 200, r.text
        for route, field, value, says in REFUSED:
            body = {"messages": CHAT} if route == "/v1/chat/completions" else {"prompt": "hi"}
            if field == "spaces_between_special_tokens":
                body["skip_special_tokens"] = False
            r = http.post(route, json={**body, "max_tokens": 2, field: value})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == field, (field, err)
            assert "unknown field" not in err["message"] and "cannot be served" in err["message"], err
            assert says is None or says in err["message"], err
    wait_kv_free(stack[0].stub)


def test_guidellm_benchmarks_every_request_successfully(url, model_dir, tmp_path, stack):
    """guidellm 0.8.1, unmodified: streamed chat completions of synthetic prompts (its tokenizer: the model's);
    its report counts 16 successful requests and no errored or incomplete one."""
    exe = shutil.which("guidellm", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("guidellm is not installed (pip install -e '.[test]')")
    report = tmp_path / "report.json"
    env = {**os.environ, "HOME": str(tmp_path), "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(
        [exe, "run", "--backend", f"kind=openai_http,target={url},model={NAME}",
         "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=16",
         "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=8",
         "--tokenizer", f"kind=huggingface_auto,model={model_dir}", "--output", f"kind=json,path={report}",
         "--disable-console-interactive"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(report.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"] if "metrics" in bench else bench["request_totals"]
    assert totals["successful"] == 16 and totals["errored"] == 0 and totals["incomplete"] == 0, totals
    wait_kv_free(stack[0].stub)


def test_cache_salt_keeps_prefix_cache_blocks_to_requests_of_the_same_salt(url, stack):
    """vLLM's cache_salt: a prompt cached under one salt is reused by the same salt only (not by another, nor by
    requests without one); the executor's prefix cache keys its blocks by the salt."""
    prompt = list(range(5, 5 + 100))  # several KV blocks

    def cached(**salt) -> int:
        with httpx.Client(base_url=url, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **salt})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0  # another salt: nothing of tenant-a's
    assert cached() == 0  # no salt: the shared cache holds none of it either
    assert cached(cache_salt="tenant-a") >= 64  # the same salt: reused
    assert cached() >= 64  # (and the unsalted request's own blocks are the unsalted one's)
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": "s" * 257})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    wait_kv_free(stack[0].stub)
