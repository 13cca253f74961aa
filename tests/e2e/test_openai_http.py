"""The scheduler's OpenAI-compatible HTTP front (--http-port), end to end with the official `openai` client
against real processes (tiny llama executor with a LoRA adapter loaded, scheduler with --http-port 0): greedy
text equals the gRPC Generate text of the same request (chat and completions, whole and streamed, sync and
async clients), n > 1 with seeds, logprobs shapes, stop sequences, usage, an adapter chosen by `model`, every
error with its HTTP status and OpenAI error body, a client that disconnects frees its KV, /tokenize,
/detokenize, /health, and the documented curl examples (docs/serving.md)."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.conftest import ROOT
from tests.docs_text import docs_text
from tests.grpc_harness import start_for, start_scheduler_for
from tests.lora_fixtures import make_peft_adapter
from tests.scheduler_client import collect, wait_kv_free

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"}]
MAX = 12
LONG = 200  # tokens of a request still running when the test acts on it (prompt + LONG < the model's 256)
README_MARKER = "<!-- openai-http-curl-examples"
SERVED_NAMES = ("smol-chat", "gpt-4o-mini")  # the small scheduler's --served-model-name
ORIGIN = "https://app.example"  # the small scheduler's --allowed-origins
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")  # the small scheduler's --chat-template


@pytest.fixture(scope="module")
def stack(request, model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    """(executor, scheduler, small scheduler): the small one has room for 1 running + 1 waiting request and a
    1 MiB body limit (429 and 413), serves the base model under two names of its own, renders chats with
    a template of its own (--chat-template) and allows one browser origin (CORS)."""
    root = tmp_path_factory.mktemp("adapters")
    make_peft_adapter(model_dir, root / "alpha", r=4, alpha=8, seed=1)
    executor = start_for(request, model_dir, "--kv-blocks", "256", "--adapter-root", str(root),
                         "--adapter", f"alpha={root / 'alpha'}")
    scheduler = start_scheduler_for(request, executor.address, "--http-port", "0")
    small = start_scheduler_for(request, executor.address, "--http-port", "0", "--max-running", "1",
                                "--max-waiting", "1", "--max-message-mb", "1",
                                "--served-model-name", *SERVED_NAMES, "--chat-template", str(template),
                                "--allowed-origins", ORIGIN)
    return executor, scheduler, small


@pytest.fixture(scope="module")
def url(stack) -> str:
    return stack[1].process.http_url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc(stack):
    return stack[1].stub


def grpc_chat(stub, max_new: int = MAX, **kw):
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT])
    return collect(stub, pb.GenerateRequest(messages=messages, stopping=pb.StoppingCriteria(max_new_tokens=max_new),
                                            **kw))


def test_ready_line_and_health(stack, url):
    scheduler = stack[1]
    assert scheduler.address == scheduler.process.addresses[0] and url.startswith("http://127.0.0.1:")
    assert httpx.get(f"{url}/health").status_code == 200


def test_models_list_the_base_model_and_adapters(client, grpc):
    base = grpc.GetModelInfo(pb.GetModelInfoRequest()).model_id
    models = client.models.list().data
    assert [m.id for m in models] == [base, "alpha"]
    assert client.models.retrieve("alpha").id == "alpha"


def test_served_model_names_replace_the_directory_name(stack, client, grpc):
    small = openai.OpenAI(base_url=f"{stack[2].process.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    cards = small.models.list().data
    assert [m.id for m in cards] == [*SERVED_NAMES, "alpha"]
    directory = grpc.GetModelInfo(pb.GetModelInfoRequest()).model_id
    assert cards[0].root == directory and cards[2].parent == SERVED_NAMES[0]
    assert small.models.retrieve(SERVED_NAMES[1]).id == SERVED_NAMES[1]
    want = client.completions.create(model="", prompt="hi there", max_tokens=MAX, temperature=0)
    for name in SERVED_NAMES:  # either name runs the base model; the response names the first
        got = small.completions.create(model=name, prompt="hi there", max_tokens=MAX, temperature=0)
        assert got.choices[0].text == want.choices[0].text and got.model == SERVED_NAMES[0]
        assert small.chat.completions.create(model=name, messages=CHAT, max_tokens=2).model == SERVED_NAMES[0]
    assert small.completions.create(model="alpha", prompt="hi", max_tokens=2).model == "alpha"
    with pytest.raises(openai.NotFoundError) as err:  # the directory name is no longer one of its names
        small.chat.completions.create(model=directory, messages=CHAT, max_tokens=2)
    assert "'smol-chat', 'gpt-4o-mini', 'alpha'" in err.value.body["message"]


def test_cors_allows_only_the_given_origin(stack):
    small, plain = stack[2].process.http_url, stack[1].process.http_url
    preflight = {"origin": ORIGIN, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    ok = httpx.options(f"{small}/v1/chat/completions", headers=preflight, timeout=30)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = httpx.options(f"{small}/v1/chat/completions", headers={**preflight, "origin": "https://evil.example"},
                          timeout=30)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert other.json()["error"]["code"] == "invalid_argument"  # OpenAI's error body, as every error
    call = httpx.post(f"{small}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"origin": ORIGIN},
                      timeout=30)
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == ORIGIN
    none = httpx.post(f"{plain}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"origin": ORIGIN},
                      timeout=30)  # a scheduler without --allowed-origins: no CORS headers, browsers refuse
    assert none.status_code == 200 and "access-control-allow-origin" not in none.headers


def test_chat_template_flag_renders_chats(stack, model_dir):
    rendered = "".join(f"[{m['role']}] {m['content']}\n" for m in CHAT) + "[assistant] "
    want = AutoTokenizer.from_pretrained(model_dir)(rendered, add_special_tokens=False)["input_ids"]
    got = httpx.post(f"{stack[2].process.http_url}/tokenize", json={"messages": CHAT}, timeout=30).json()
    assert got["tokens"] == want
    own = httpx.post(f"{stack[1].process.http_url}/tokenize", json={"messages": CHAT}, timeout=30).json()
    assert own["tokens"] != want  # the other scheduler keeps the model's template


def test_chat_greedy_equals_grpc_whole_and_streamed(client, grpc):
    want = grpc_chat(grpc)
    got = client.chat.completions.create(model="", messages=CHAT, max_tokens=MAX, temperature=0)
    assert got.object == "chat.completion" and len(got.choices) == 1
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == pb.FINISH_REASON_LENGTH else "stop")
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens,
                                                                       want.usage.completion_tokens)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens

    chunks = list(client.chat.completions.create(messages=CHAT, model="", max_completion_tokens=MAX, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == got.choices[0].finish_reason
    assert all(c.usage is None for c in chunks[:-1]) and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_text_and_token_prompts_equal_grpc(client, grpc):
    ids = [1, 5, 9, 33, 44, 100, 7]
    want_text = collect(grpc, pb.GenerateRequest(text="hello world", stopping=pb.StoppingCriteria(max_new_tokens=MAX)))
    want_ids = collect(grpc, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                                stopping=pb.StoppingCriteria(max_new_tokens=MAX)))
    got = client.completions.create(model="", prompt="hello world", max_tokens=MAX, temperature=0)
    assert got.object == "text_completion" and got.choices[0].text == want_text.text
    assert got.usage.prompt_tokens == want_text.usage.prompt_tokens
    got = client.completions.create(model="", prompt=[ids, ids[:3]], max_tokens=MAX, temperature=0)
    assert [c.index for c in got.choices] == [0, 1] and got.choices[0].text == want_ids.text
    assert got.usage.prompt_tokens == len(ids) + 3  # each prompt counted once
    got = client.completions.create(model="", prompt=ids, max_tokens=MAX, temperature=0)
    assert got.choices[0].text == want_ids.text
    streamed = list(client.completions.create(model="", prompt="hello world", max_tokens=MAX, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want_text.text


def test_async_client_streams_concurrently(url, grpc):
    want = grpc_chat(grpc)

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as aclient:
            async def one() -> str:
                stream = await aclient.chat.completions.create(model="", messages=CHAT, max_tokens=MAX,
                                                               temperature=0, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream])
            whole = await aclient.chat.completions.create(model="", messages=CHAT, max_tokens=MAX, temperature=0)
            return [whole.choices[0].message.content, *await asyncio.gather(*(one() for _ in range(4)))]

    assert asyncio.run(run()) == [want.text] * 5


def test_n_choices_are_independent_seeded_requests(client, grpc):
    got = client.completions.create(model="", prompt="the quick brown fox", max_tokens=MAX, temperature=1.0,
                                    seed=7, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for i, choice in enumerate(got.choices):
        want = collect(grpc, pb.GenerateRequest(text="the quick brown fox", sampling=cpb.SamplingParams(
            temperature=1.0, seed=7 + i), stopping=pb.StoppingCriteria(max_new_tokens=MAX)))
        assert choice.text == want.text, i
    assert len({c.text for c in got.choices}) > 1, "different seeds should give different samples"
    chat = client.chat.completions.create(model="", messages=CHAT, max_tokens=MAX, temperature=0, n=2, stream=True)
    texts = ["", ""]
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [grpc_chat(grpc).text] * 2


def test_logprobs_shapes(client, grpc):
    want = grpc_chat(grpc, top_logprobs=3)
    got = client.chat.completions.create(model="", messages=CHAT, max_tokens=MAX, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"return_tokens_as_token_ids": True})
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == len(want.token_ids)
    assert [int(t.token.removeprefix("token_id:")) for t in content] == want.token_ids
    for t, w in zip(content, want.logprobs):
        assert t.logprob == pytest.approx(w.logprob, abs=1e-5) and len(t.top_logprobs) == 3
        assert [int(a.token.removeprefix("token_id:")) for a in t.top_logprobs] == [a.token_id for a in w.top_logprobs]
    plain = client.chat.completions.create(model="", messages=CHAT, max_tokens=MAX, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] and t.bytes == list(t.token.encode()) for t in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model="", messages=CHAT, max_tokens=2).choices[0].logprobs is None

    got = client.completions.create(model="", prompt="hello world", max_tokens=MAX, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    n = got.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:],
                                                                              lp.tokens))
    # token ids as names: distinct tokens never share a key (pieces of partial UTF-8 all read "\ufffd")
    lp = client.completions.create(model="", prompt="hello world", max_tokens=MAX, temperature=0, logprobs=2,
                                   extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3 and top[token] == value  # the sampled token is always among them


def test_stop_sequences_and_stop_reason(client):
    full = client.completions.create(model="", prompt="hello world", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i:i + 3] for i in range(4, len(full) - 3) if full[i:i + 3].strip() == full[i:i + 3])
    at = full.find(stop)
    for value in (stop, [stop, "never-in-this-text"]):
        got = client.completions.create(model="", prompt="hello world", max_tokens=40, temperature=0, stop=value,
                                        extra_body={"ignore_eos": True}).choices[0]
        assert got.text == full[:at] and got.finish_reason == "stop"
        assert got.model_extra["stop_reason"] == stop
    chat = client.chat.completions.create(model="", messages=CHAT, max_tokens=3, temperature=0)
    assert chat.choices[0].model_extra["stop_reason"] is None


def test_an_adapter_is_chosen_by_model(client, grpc):
    ids = [1, 250, 17, 3, 99]
    as_ids = {"return_tokens_as_token_ids": True, "ignore_eos": True}

    def tokens(model: str) -> list[int]:
        got = client.completions.create(model=model, prompt=ids, max_tokens=MAX, temperature=0, logprobs=0,
                                        extra_body=as_ids)
        assert got.model == (model or got.model)
        return [int(t.removeprefix("token_id:")) for t in got.choices[0].logprobs.tokens]

    def grpc_tokens(adapter: str) -> list[int]:
        return collect(grpc, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), adapter=adapter,
                                                stopping=pb.StoppingCriteria(max_new_tokens=MAX,
                                                                             ignore_eos=True))).token_ids

    base_id = grpc.GetModelInfo(pb.GetModelInfoRequest()).model_id
    assert tokens("alpha") == grpc_tokens("alpha")
    assert tokens(base_id) == tokens("") == grpc_tokens("")
    assert tokens("alpha") != tokens("")


def _error(response: httpx.Response, status: int, code: str, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["param"] == param
    assert err["type"] == {404: "invalid_request_error", 400: "invalid_request_error", 413: "invalid_request_error",
                           429: "rate_limit_error"}[status]
    return err["message"]


def test_errors_have_the_openai_body_and_the_grpc_status(url, client):
    post = lambda path, body, **kw: httpx.post(f"{url}{path}", json=body, timeout=30, **kw)
    chat = {"messages": CHAT, "max_tokens": 2}
    _error(post("/v1/chat/completions", {**chat, "temperature": "hot"}), 400, "invalid_argument", "temperature")
    _error(post("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": 5}]}), 400,
           "invalid_argument", "messages.0.content")
    _error(post("/v1/chat/completions", {"max_tokens": 2}), 400, "invalid_argument", "messages")
    _error(post("/v1/completions", {"prompt": [1, -2]}), 400, "invalid_argument", "prompt.1")
    _error(post("/v1/completions", {"prompt": "x", "max_tokens": 0}), 400, "invalid_argument", "max_tokens")
    _error(post("/v1/completions", {"prompt": "x", "suffix": "y"}), 400, "invalid_argument", "suffix")
    _error(post("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}), 400, "invalid_argument",
           "tools.0.function")  # (tool calls themselves: tests/e2e/test_structured_output.py)
    _error(post("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}), 400,
           "invalid_argument", "tool_choice")  # "auto", the default with tools
    _error(post("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, "invalid_argument", "messages.0.content.0")
    # the scheduler's own checks name the parameter as the client sent it (docs/serving.md#errors)
    assert _error(post("/v1/completions", {"prompt": "x", "top_p": 0}), 400, "invalid_argument",
                  "top_p").startswith("top_p must be in (0, 1]")
    assert "255" in _error(post("/v1/completions", {"prompt": "x", "max_tokens": 1000}), 400, "out_of_range",
                           "max_tokens")
    assert "vocabulary" in _error(post("/v1/completions", {"prompt": [1, 10**6]}), 400, "invalid_argument", "prompt")
    _error(httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
           400, "invalid_argument")
    assert "nope" in _error(post("/v1/chat/completions", {**chat, "model": "nope"}), 404, "model_not_found")
    _error(httpx.get(f"{url}/v1/nothing"), 404, "not_found")
    scrape = httpx.get(f"{url}/metrics")  # the scheduler's Prometheus metrics (scheduler/metrics.py)
    assert scrape.status_code == 200 and "tandem:time_to_first_token_seconds" in scrape.text
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt="x", max_tokens=0)  # (0 only with echo)
    assert info.value.param == "max_tokens"


def test_oversized_body_is_413(stack):
    url = stack[2].process.http_url  # --max-message-mb 1
    big = {"prompt": "x" * (1024 * 1024 + 10), "max_tokens": 2}
    _error(httpx.post(f"{url}/v1/completions", json=big, timeout=30), 413, "resource_exhausted")
    body = json.dumps(big).encode()
    chunked = httpx.post(f"{url}/v1/completions", content=iter([body[:4096], body[4096:]]), timeout=30,
                         headers={"content-type": "application/json"})  # no Content-Length: counted as it comes
    _error(chunked, 413, "resource_exhausted")


def _load(scheduler) -> tuple[int, int]:
    """(running, waiting) requests of the scheduler's executor, as GetModelInfo reports them."""
    e = scheduler.stub.GetModelInfo(pb.GetModelInfoRequest()).executors[0]
    return e.running, e.waiting


def _wait_idle(scheduler, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while _load(scheduler) != (0, 0):  # aborts of closed streams land when the server sees the disconnect
        assert time.monotonic() < deadline, f"still busy after {timeout}s: {_load(scheduler)}"
        time.sleep(0.02)


def test_a_full_queue_is_429(stack):
    """1 running + 1 queued fill the small scheduler: a third request is 429 with Retry-After, before any work. A
    streamed request gets its status line only once admitted (docs/operations.md#overload), so the queued one is
    sent without waiting for its headers, and the test waits until the scheduler reports it queued."""
    executor, _, small = stack
    url = small.process.http_url  # 1 running + 1 waiting at most
    # min_tokens: one decode step per call until then, so the running request outlives what the test does
    long = {"prompt": "hello", "max_tokens": LONG, "min_tokens": LONG, "ignore_eos": True, "stream": True}

    async def full() -> httpx.Response | None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for _ in range(3):  # the running request must outlive the next two: try again if it did not
                await asyncio.to_thread(_wait_idle, small)
                async with http.stream("POST", "/v1/completions", json=long) as running:
                    assert running.status_code == 200
                    lines = running.aiter_lines()  # kept: an iterator dropped half-way closes the connection
                    await anext(lines)  # a first chunk: it runs
                    queued = asyncio.create_task(http.send(http.build_request("POST", "/v1/completions", json=long),
                                                           stream=True))
                    try:
                        while (load := await asyncio.to_thread(_load, small)) == (1, 0) and not queued.done():
                            await asyncio.sleep(0.01)
                        if load != (1, 1):
                            continue
                        assert not queued.done(), "a queued stream got its status line before its admission"
                        return await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
                    finally:
                        queued.cancel()  # closes its connection: aborted in the queue
                        got = (await asyncio.gather(queued, return_exceptions=True))[0]
                        if isinstance(got, httpx.Response):
                            await got.aclose()
        return None

    third = asyncio.run(full())
    assert third is not None, "the running request always ended too soon"
    assert "queue is full" in _error(third, 429, "resource_exhausted")
    assert third.headers["retry-after"].isdigit() and int(third.headers["retry-after"]) >= 1  # whole seconds
    wait_kv_free(executor.stub)  # the two streams were closed mid-way: both aborted


def _active_caches(executor) -> int:
    return executor.stub.GetInfo(epb.GetInfoRequest()).kv.active_caches


def test_a_client_that_disconnects_frees_its_kv(stack, url):
    executor, scheduler, _ = stack
    wait_kv_free(executor.stub)
    cancelled = scheduler.stderr().count("cancelled by the client")
    # min_tokens: one decode step per call until then, so the request is surely still running when the client
    # goes away (multi-step bursts finish LONG tokens of the tiny model in well under 0.1 s)
    body = {"messages": CHAT, "max_tokens": LONG, "min_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            events = (line for line in stream.iter_lines() if line.startswith("data:"))
            for _ in range(3):  # the role chunk and two chunks of text
                next(events)
            assert _active_caches(executor) > 0, "the request ended before the test could disconnect it"
        # leaving the block closed the connection mid-stream
    wait_kv_free(executor.stub)

    async def whole() -> None:  # not streamed: the scheduler watches the connection while it waits
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            task = asyncio.create_task(http.post("/v1/chat/completions", json={**body, "stream": False}))
            while _active_caches(executor) == 0:
                assert not task.done(), "the request ended before the test could disconnect it"
                await asyncio.sleep(0.01)
            task.cancel()  # closes the connection
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(whole())
    wait_kv_free(executor.stub)
    assert scheduler.stderr().count("cancelled by the client") == cancelled + 2


def test_tokenize_and_detokenize(url, grpc):
    want = grpc.Tokenize(pb.TokenizeRequest(text="hello world"))
    got = httpx.post(f"{url}/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert got["tokens"] == list(want.token_ids) and got["token_strs"] == list(want.pieces)
    assert got["count"] == len(want.token_ids) and got["max_model_len"] == 256
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] == grpc_chat(grpc, max_new=1).usage.prompt_tokens
    text = httpx.post(f"{url}/detokenize", json={"tokens": got["tokens"]}).json()["prompt"]
    assert text.endswith("hello world")
    _error(httpx.post(f"{url}/detokenize", json={"tokens": [10**6]}), 400, "invalid_argument")
    _error(httpx.post(f"{url}/tokenize", json={}), 400, "invalid_argument", "prompt")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert httpx.post(f"{url}/tokenize", json={"messages": CHAT, "tools": [tool]}).json()["tokens"] == chat["tokens"]
    bad = httpx.post(f"{url}/tokenize", json={"messages": CHAT, "tools": [tool, tool]})  # (its template ignores
    assert bad.status_code == 400 and "names an earlier tool" in bad.json()["error"]["message"]  # tools; checked)


def _readme_curl_commands() -> list[str]:
    """The shell commands of the docs block after the marker (backslash continuations joined)."""
    text = docs_text()  # README.md + docs/*.md: the block lives in docs/serving.md
    assert text.count(README_MARKER) == 1, f"README.md + docs/*.md must hold the marker {README_MARKER} once"
    block = re.search(r"```bash\n(.*?)```", text[text.index(README_MARKER):], re.DOTALL).group(1)
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_examples_run(url):
    commands = _readme_curl_commands()
    assert len(commands) >= 4 and all(c.startswith("curl ") for c in commands)
    for command in commands:
        command = command.replace("http://127.0.0.1:8000", url).replace("curl ", "curl -sS ", 1)
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
        out = proc.stdout.strip()
        if out.startswith("data:"):
            events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), command
        else:
            assert "error" not in json.loads(out), command


@pytest.mark.parametrize("flags, says", [
    (["--chat-template", "{missing}"], "--chat-template: cannot read"),
    (["--chat-template", "{broken}"], "--chat-template: the chat template does not compile"),
    (["--served-model-name", "a", "a"], "--served-model-name: a name is given twice"),
])
def test_a_bad_flag_stops_the_scheduler_before_it_serves(tmp_path, flags, says):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    args = [a.format(missing=tmp_path / "none.jinja", broken=broken) for a in flags]
    # (an executor that is not there: the flags are checked before the scheduler waits for one)
    run = subprocess.run([sys.executable, "-m", "scheduler", "--executor", "127.0.0.1:1", "--port", "0",
                          "--connect-timeout", "30", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "READY" not in run.stdout
    assert says in run.stderr, run.stderr[-2000:]
