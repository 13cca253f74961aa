"""Property-based fuzzing of the OpenAI-compatible HTTP front against real processes: a tiny llama
executor and a scheduler with default flags. For every body hypothesis draws (tests/fuzz/strategies.py:
valid-shaped chat completions, completions, tokenize and detokenize requests with huge integers, surrogates,
odd Unicode, wrong types and nesting; any JSON to any route; raw bytes and odd headers on a socket):

- the answer is below 500: a 200 (whole, or an SSE stream of JSON chunks ending [DONE] whose error events, if
  any, are the client's) or an error with OpenAI's body (`message`, `type`, `param`, a non-null `code`);
- the server answers the next normal request;
- at the end of each property, every KV block is free again.

Examples per property: tests/fuzz/conftest.py (`--fuzz-examples N` for a long run).
"""
from __future__ import annotations

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.fuzz import strategies as fs
from tests.fuzz.http_raw import connect, openai_error, read_response
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import wait_kv_free

POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
NORMAL = {"prompt": "hello", "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def executor(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", "256")


@pytest.fixture(scope="module")
def url(request, executor) -> str:
    return start_scheduler_for(request, executor.address, "--http-port", "0").process.http_url


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=300) as client:  # a long run may draw 64 prompts x 255 tokens
        yield client


def _settings(fuzz_examples: tuple[int, bool], share: float = 1.0) -> settings:
    examples, derandomize = fuzz_examples
    return settings(max_examples=max(1, int(examples * share)), deadline=None, derandomize=derandomize,
                    database=None, suppress_health_check=list(HealthCheck), print_blob=True)


def _check_answer(status: int, content_type: str, content: bytes, what: object) -> None:
    assert status < 500, (status, content[:500], what)
    if status >= 400:
        event(f"{status} {openai_error(status, content)['code']}")  # --hypothesis-show-statistics shows the mix
        return
    event(f"{status}")
    if "text/event-stream" in content_type:
        events = [line[len("data: "):] for line in content.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (content[-300:], what)
        for data in events[:-1]:
            chunk = json.loads(data)
            if "error" in chunk:  # after the 200: the error travels as an event; it must be the client's
                err = openai_error(400 if chunk["error"]["type"] == "invalid_request_error" else 429, chunk)
                assert err["code"] != "internal", (err, what)
    elif content and "json" in content_type:
        json.loads(content)


def _post(http: httpx.Client, route: str, body: object) -> None:
    content = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity: Python's JSON reads them
    r = http.post(route, content=content, headers={"content-type": "application/json"})
    _check_answer(r.status_code, r.headers.get("content-type", ""), r.content, (route, body))
    after = http.post("/v1/completions", json=NORMAL)  # the next normal request is served
    assert after.status_code == 200, (after.text, route, body)


def _settled(http: httpx.Client, executor) -> None:
    assert http.post("/v1/completions", json=NORMAL).status_code == 200
    wait_kv_free(executor.stub, timeout=30)


def test_chat_completion_bodies(http, executor, fuzz_examples):
    @_settings(fuzz_examples)
    @given(fs.chat_bodies())
    def check(body):
        _post(http, "/v1/chat/completions", body)

    check()
    _settled(http, executor)


def test_completion_bodies(http, executor, fuzz_examples):
    @_settings(fuzz_examples)
    @given(fs.completion_bodies())
    def check(body):
        _post(http, "/v1/completions", body)

    check()
    _settled(http, executor)


def test_tokenize_and_detokenize_bodies(http, executor, fuzz_examples):
    @_settings(fuzz_examples)
    @given(st.one_of(st.tuples(st.just("/tokenize"), fs.tokenize_bodies()),
                     st.tuples(st.just("/detokenize"), fs.detokenize_bodies())))
    def check(route_body):
        _post(http, *route_body)

    check()
    _settled(http, executor)


def test_any_json_to_any_route(http, executor, fuzz_examples):
    @_settings(fuzz_examples)
    @given(st.sampled_from(POST_ROUTES), fs.NASTY)
    def check(route, body):
        _post(http, route, body)

    check()
    _settled(http, executor)


def _raw(url: str, raw: bytes) -> None:
    """Sends raw bytes; reads the answer, or, if the server waits for more (a body it was promised), ends the
    sending side and reads what comes before the close."""
    with connect(url) as sock:
        try:
            sock.sendall(raw)
            sock.settimeout(1.0)
            try:
                answer = read_response(sock)
            except socket.timeout:
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(30)
                answer = read_response(sock)
        except (ConnectionResetError, BrokenPipeError):
            return  # the server closed while bytes were still coming: refused, nothing answered
    event(f"raw {answer.status}")
    if answer.status is None:
        return
    assert answer.status < 500, (answer, raw[:300])
    if answer.status >= 400 and "json" in answer.headers.get("content-type", "") and answer.body:
        openai_error(answer.status, answer.body)


def test_raw_requests_and_headers(url, http, executor, fuzz_examples):
    @_settings(fuzz_examples, share=2.0)
    @given(fs.raw_requests())
    def check(raw):
        _raw(url, raw)
        assert http.get("/health").status_code == 200

    check()
    _settled(http, executor)
