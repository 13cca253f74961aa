"""The HTTP front against malformed input and greedy or slow clients, with real processes: a tiny
llama executor and two schedulers — one with default limits, one with short read deadlines, small connection
caps and tokens with a per-token share. Each refusal is a 4xx with OpenAI's error body naming the field or
the limit, the next request on the same connection (or a neighbour's) is served, and the KV ends idle.

1. lone UTF-16 surrogates in any string field -> 400 naming it, the keep-alive connection still usable;
2. integers past their wire type's range -> 400 naming the field; unknown fields -> 400 naming them;
5. slow headers, slow bodies, silent connections -> closed (408 when a response can be sent); connections past
   the caps -> 503 / 429, others unaffected;
6. prompts per request capped; per-token shares count choices (prompts x n);
8. every error path's body has a non-null `code`.
"""
from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import httpx
import pytest

from tests.fuzz.http_raw import connect, exchange, openai_error, read_response, request_bytes
from tests.e2e.test_prometheus_metrics import metrics_url
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import wait_kv_free
from tests.security_fixtures import new_token, write_tokens

BAD = "\ud800"  # a lone surrogate: json.dumps writes it as the escape \ud800
CHAT = [{"role": "user", "content": "hi there"}]
ALICE, BOB, ADMIN = new_token(), new_token(), new_token()
SHARE = 4  # --max-concurrent-per-token of the guarded scheduler
HEADER_S, BODY_S = 1.0, 1.5  # its read deadlines
MAX_CONNECTIONS, PER_CLIENT = 6, 4


@pytest.fixture(scope="module")
def executor(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", "256")


@pytest.fixture(scope="module")
def url(request, executor) -> str:
    """A scheduler with the default HTTP limits."""
    return start_scheduler_for(request, executor.address, "--http-port", "0").process.http_url


@pytest.fixture(scope="module")
def guarded_scheduler(request, executor, tmp_path_factory):
    """The scheduler with small limits (its metrics on a port of their own: scraping them takes no HTTP place)."""
    tokens = write_tokens(tmp_path_factory.mktemp("tokens") / "scheduler.tokens",
                          {ALICE: "user", BOB: "user", ADMIN: "admin"})
    return start_scheduler_for(
        request, executor.address, "--http-port", "0", "--metrics-port", "0", "--auth-token-file", str(tokens),
        "--max-concurrent-per-token", str(SHARE), "--max-message-mb", "1",
        "--http-header-timeout-s", str(HEADER_S), "--http-body-timeout-s", str(BODY_S),
        "--http-max-connections", str(MAX_CONNECTIONS), "--http-max-connections-per-client", str(PER_CLIENT))


@pytest.fixture(scope="module")
def guarded(guarded_scheduler) -> str:
    return guarded_scheduler.process.http_url


def _post_on(conn: http.client.HTTPConnection, path: str, body: dict | str) -> tuple[int, dict, bool]:
    """(status, JSON body, whether the server keeps the connection) of one request on `conn`."""
    conn.request("POST", path, body if isinstance(body, str) else json.dumps(body),
                 {"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read()), not response.will_close


def _connection(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60)


def _ok_completion(conn: http.client.HTTPConnection) -> None:
    status, body, kept = _post_on(conn, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert status == 200 and kept and body["choices"][0]["finish_reason"] == "length", body


SURROGATES = [  # (route, body, the param named)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" + BAD}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": BAD}]}, "messages.0.name"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {BAD: {"type": "string"}}}}}]},
     "tools.0.function.parameters"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["ok", BAD]}}}}, "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": BAD}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "x" + BAD + "y"]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\n", BAD]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {BAD: 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "user": BAD}, "user"),
    ("/v1/completions", {"prompt": "hi", "model": BAD}, "model"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["a", BAD]}, "guided_choice"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "object", "title": BAD}}, "guided_json"),
    ("/tokenize", {"prompt": BAD}, "prompt"),
    ("/tokenize", {"messages": [{"role": BAD, "content": "x"}]}, "messages.0.role"),
]


def test_lone_surrogates_are_400_naming_the_field_and_the_connection_stays(url, executor):
    conn = _connection(url)
    try:
        for route, body, param in SURROGATES:
            status, payload, kept = _post_on(conn, route, body)
            assert status == 400 and kept, (route, param, payload)
            err = openai_error(400, payload)
            assert err["param"] == param and err["code"] == "invalid_argument", err
            assert "surrogate" in err["message"]
            _ok_completion(conn)  # the same keep-alive connection serves the next request
    finally:
        conn.close()
    wait_kv_free(executor.stub)


HUGE = [  # (route, fields, the param named)
    ("/v1/completions", {"max_tokens": 2**40}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 2**33}, "max_completion_tokens"),
    ("/v1/completions", {"min_tokens": 2**40}, "min_tokens"),
    ("/v1/completions", {"top_k": 2**40}, "top_k"),
    ("/v1/completions", {"n": 2**40}, "n"),
    ("/v1/completions", {"seed": 2**64}, "seed"),
    ("/v1/completions", {"seed": -1}, "seed"),
    ("/v1/completions", {"logprobs": 2**40}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2**40}, "top_logprobs"),
    ("/v1/completions", {"best_of": 2**40}, "best_of"),
    ("/v1/completions", {"stop_token_ids": [2**32]}, "stop_token_ids.0"),
    ("/v1/completions", {"logit_bias": {str(2**32): 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 10**400}}, "logit_bias"),
    ("/v1/completions", {"temperature": 10**400}, "temperature"),
    ("/v1/completions", {"presence_penalty": 1e300}, "presence_penalty"),  # past float32
    ("/v1/completions", {"prompt": [[1, 2**32]]}, "prompt.0.1"),
    ("/detokenize", {"tokens": [1, 2**40]}, "tokens.1"),
]


def test_integers_past_their_range_are_400_naming_the_field(url, executor):
    conn = _connection(url)
    try:
        for route, fields, param in HUGE:
            base = {"messages": CHAT} if route == "/v1/chat/completions" else {} if route == "/detokenize" \
                else {"prompt": "hi"}
            status, payload, kept = _post_on(conn, route, {**base, **fields})
            assert status == 400 and kept, (fields, payload)
            assert openai_error(400, payload)["param"] == param, (fields, payload)
        # A number too long to read at all (Python reads integers of at most 4300 digits): 400, not 500.
        status, payload, _ = _post_on(conn, "/v1/completions", '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}")
        assert status == 400 and "too many digits" in openai_error(400, payload)["message"]
        _ok_completion(_connection(url))  # (that one closed its connection: a neighbour's)
    finally:
        conn.close()
    wait_kv_free(executor.stub)


UNKNOWN = [  # (route, fields, the param named): fields a client may rely on that this server does not serve
    ("/v1/completions", {"beam_width": 4}, "beam_width"),  # (vLLM's own extras are known: test_vllm_extensions.py)
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),  # OpenAI's
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "weight": 0}]}, "messages.0.weight"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True, "chunk_tokens": 4}},
     "stream_options.chunk_tokens"),
    ("/tokenize", {"prompt": "hi", "truncate": 3}, "truncate"),
]


def test_unknown_fields_are_400_naming_them_and_echoed_messages_are_taken(url, executor):
    conn = _connection(url)
    try:
        for route, fields, param in UNKNOWN:
            base = {"messages": CHAT} if route == "/v1/chat/completions" else {"prompt": "hi"}
            status, payload, kept = _post_on(conn, route, {**base, **fields})
            assert status == 400 and kept, (fields, payload)
            err = openai_error(400, payload)
            assert err["param"] == param and f"unknown field '{param}'" in err["message"], err
        # What the openai package sends when a response's message goes back into the next request (its
        # metadata fields, null when unused) is taken: multi-turn code works unchanged.
        first = _post_on(conn, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0})
        echoed = {**first[1]["choices"][0]["message"], "refusal": None, "annotations": [], "audio": None,
                  "function_call": None}
        status, payload, _ = _post_on(conn, "/v1/chat/completions", {
            "messages": [*CHAT, echoed, {"role": "user", "content": "more"}], "max_tokens": 2, "temperature": 0})
        assert status == 200, payload
        # A media part is refused for what it is, not as an unknown field.
        status, payload, _ = _post_on(conn, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]})
        assert status == 400 and "image_url" in openai_error(400, payload)["message"], payload
    finally:
        conn.close()
    wait_kv_free(executor.stub)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_free_form_json_nests_at_most_64_levels(url, executor):
    for fields, param in (({"guided_json": _nested(70)}, "guided_json"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"schema": _nested(40)}}},
                           "response_format.json_schema.schema")):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, **fields}, timeout=60)
        assert r.status_code == 400 and openai_error(400, r.content)["param"] == param, r.text
        assert "64 levels" in r.json()["error"]["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "guided_json": _nested(20)},
                    timeout=60)
    assert ok.status_code == 200, ok.text
    wait_kv_free(executor.stub)


def test_prompts_per_request_are_capped(url, executor):
    err = httpx.post(f"{url}/v1/completions", json={"prompt": ["hi"] * 65, "max_tokens": 1}, timeout=60)
    assert err.status_code == 400
    e = openai_error(400, err.content)
    assert e["param"] == "prompt" and "--max-prompts-per-request" in e["message"] and "65" in e["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": ["hi"] * 64, "max_tokens": 1}, timeout=120)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64
    wait_kv_free(executor.stub)


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_per_token_share_counts_choices(guarded, executor):
    post = lambda token, body: httpx.post(f"{guarded}/v1/completions", json=body, headers=_bearer(token), timeout=120)
    too_many = post(ALICE, {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})  # 6 choices > SHARE alone: 400
    assert too_many.status_code == 400
    assert "6 choices" in openai_error(400, too_many.content)["message"] and f"--max-concurrent-per-token {SHARE}" \
        in too_many.json()["error"]["message"]
    assert post(ALICE, {"prompt": ["a", "b"], "n": 2, "max_tokens": 1}).status_code == 200  # exactly SHARE
    long = {"prompt": ["a", "b", "c"], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=guarded, timeout=120, headers=_bearer(ALICE)) as http:
        with http.stream("POST", "/v1/completions", json=long) as running:  # 3 of ALICE's 4 choices in flight
            assert running.status_code == 200
            lines = running.iter_lines()
            next(lines)
            executor.process.send_signal(signal.SIGSTOP)  # hold them there: nothing can finish meanwhile
            bob: dict = {}
            try:
                refused = post(ALICE, {"prompt": "x", "n": 2, "max_tokens": 1})  # 3 + 2 > 4
                assert refused.status_code == 429
                err = openai_error(429, refused.content)
                assert err["code"] == "resource_exhausted" and "3 choices in flight" in err["message"]
                thread = threading.Thread(target=lambda: bob.update(r=post(BOB, {"prompt": ["a", "b"], "n": 2,
                                                                                 "max_tokens": 1})))
                thread.start()  # BOB's share is his own
            finally:
                executor.process.send_signal(signal.SIGCONT)
            thread.join(120)
            assert bob["r"].status_code == 200 and len(bob["r"].json()["choices"]) == 4
    assert post(ALICE, {"prompt": ["a", "b"], "n": 2, "max_tokens": 1}).status_code == 200  # the share came back
    wait_kv_free(executor.stub)


def _closed_by_server(sock, deadline_s: float = 30.0):
    """The server's answer (or None) once it closed the connection; fails if it keeps it past deadline_s."""
    sock.settimeout(deadline_s)
    return read_response(sock)


def test_slow_headers_and_bodies_are_cut_off_and_others_are_served(guarded, executor):
    silent = connect(guarded)
    partial = connect(guarded, "127.0.0.2")
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    trickle = connect(guarded, "127.0.0.3")
    slow_body = connect(guarded, "127.0.0.4")
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    slow_body.sendall(request_bytes("POST", "/v1/completions", body, _bearer(ALICE))[:-5])  # all but 5 bytes
    started = time.monotonic()
    try:
        for _ in range(40):  # a byte every 0.1 s never extends the header deadline
            try:
                trickle.sendall(b"X-A: b\r\n"[:1])
            except OSError:
                break
            time.sleep(0.1)
        # Meanwhile a neighbour is served at once.
        ok = httpx.post(f"{guarded}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=_bearer(BOB),
                        timeout=60)
        assert ok.status_code == 200
        assert _closed_by_server(silent).status is None  # nothing sent: closed without an answer
        for sock, phase in ((partial, "headers"), (trickle, "headers"), (slow_body, "body")):
            answer = _closed_by_server(sock)
            assert answer.status == 408, (phase, answer)
            err = openai_error(408, answer.body)
            assert err["code"] == "deadline_exceeded" and f"--http-{'header' if phase == 'headers' else 'body'}" \
                "-timeout-s" in err["message"]
        assert time.monotonic() - started < 30  # bounded (the deadlines are 1-1.5 s; generous for a busy CI)
    finally:
        for sock in (silent, partial, trickle, slow_body):
            sock.close()
    wait_kv_free(executor.stub)


def _refused_by_caps(scheduler) -> dict[str, float]:
    """tandem:requests_refused_total of the connection caps, from the metrics port (an admin call)."""
    text = httpx.get(metrics_url(scheduler), headers=_bearer(ADMIN), timeout=30).text
    return {reason: float(line.rsplit(" ", 1)[1]) for reason in ("http_connections", "http_connections_per_client")
            for line in text.splitlines() if line.startswith(f'tandem:requests_refused_total{{reason="{reason}"}}')}


def test_connections_past_the_caps_are_refused_and_the_open_ones_go_on(guarded, guarded_scheduler, executor):
    before = _refused_by_caps(guarded_scheduler)
    held = [connect(guarded) for _ in range(PER_CLIENT)]  # 127.0.0.1 at its cap
    try:
        for sock in held:  # each stays usable: one request on each (headers complete, so no deadline cuts it)
            sock.sendall(request_bytes("GET", "/health"))
            assert read_response(sock).status == 200
        over = exchange(guarded, request_bytes("GET", "/health"))
        assert over.status == 429 and over.headers.get("connection") == "close"
        assert over.headers.get("retry-after") == "1"  # whole seconds: when one of its connections may have closed
        assert "--http-max-connections-per-client" in openai_error(429, over.body)["message"]
        other = [connect(guarded, "127.0.0.2") for _ in range(MAX_CONNECTIONS - PER_CLIENT)]
        try:
            for sock in other:
                sock.sendall(request_bytes("GET", "/health"))
                assert read_response(sock).status == 200
            full = exchange(guarded, request_bytes("GET", "/health"), source="127.0.0.3")
            assert full.status == 503 and full.headers.get("retry-after") == "1"
            assert openai_error(503, full.body)["code"] == "unavailable"
            held[0].sendall(request_bytes("GET", "/health"))  # the open ones go on
            assert read_response(held[0]).status == 200
        finally:
            for sock in other:
                sock.close()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 30
    while True:  # the server counts the closed ones off as it sees them go
        again = exchange(guarded, request_bytes("GET", "/health"), source="127.0.0.3")
        if again.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert again.status == 200
    after = _refused_by_caps(guarded_scheduler)  # each refusal counted under its cap's reason
    assert after["http_connections_per_client"] == before["http_connections_per_client"] + 1, (before, after)
    assert after["http_connections"] >= before["http_connections"] + 1, (before, after)  # (+ the loop's retries)
    wait_kv_free(executor.stub)


def test_every_error_path_has_the_openai_body_with_a_code(url, guarded):
    cases = [  # (bytes, status) on the default scheduler
        (request_bytes("POST", "/v1/completions", b"{not json"), 400),
        (request_bytes("POST", "/v1/completions", b"[1, 2]"), 400),
        (request_bytes("POST", "/v1/completions", b""), 400),
        (request_bytes("POST", "/v1/completions", b"\xff\xfe{}"), 400),
        (request_bytes("POST", "/v1/completions", b'{"prompt": "hi"}', {"content-type": "text/plain"}), 400),
        (request_bytes("POST", "/v1/completions", b"[" * 100_000), 400),
        (request_bytes("POST", "/v1/completions", b'{"prompt": "hi", "n": 17}'), 400),
        (request_bytes("POST", "/v1/completions", b'{"prompt": "hi", "model": "nope"}'), 404),
        (request_bytes("GET", "/v1/nothing"), 404),
        (request_bytes("DELETE", "/health"), 405),
        (b"\x16\x03\x01 not http at all\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n" + b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n", 400),
    ]
    for raw, status in cases:
        got = exchange(url, raw)
        assert got.status == status, (raw[:60], got)
        err = openai_error(status, got.body)
        if status == 404 and b"nope" in raw:
            assert err["code"] == "model_not_found"
    too_big = exchange(guarded, request_bytes("POST", "/v1/completions", b"x" * (1024 * 1024 + 1), _bearer(ALICE)))
    assert too_big.status == 413 and openai_error(413, too_big.body)["code"] == "resource_exhausted"
    no_token = exchange(guarded, request_bytes("POST", "/v1/completions", b'{"prompt": "hi"}'))
    assert no_token.status == 401 and openai_error(401, no_token.body)["code"] == "unauthenticated"
