"""Every validation error of the scheduler names the field at fault in the caller's terms, with real processes (one
executor + scheduler pair): over HTTP a 400 whose `param` is the OpenAI parameter as the client sent it (`top_p`,
`max_completion_tokens`, `stop.0`, `messages.0.tool_calls.0.name`...) and whose message says it, never an internal
name (`sampling.`, `max_new_tokens`) nor a host path; over gRPC INVALID_ARGUMENT (OUT_OF_RANGE for a length past
the model's) whose message names the tandem.generate.v1 field path. The cases walk the checks of
scheduler/rpc/codec.py, tandem/sampling_params.py, tandem/codec.py, scheduler/text/chat_input.py and
scheduler/structured/grammar.py that a generate request reaches (the HTTP front's own checks name their
`param` where they are raised: scheduler/http/convert.py, the request schemas).

The executor's checks (executor_service/request_validation.py and the item conversions of its codec) are walked
over gRPC against the executor directly: an item's own error is its ItemStatus, INVALID_ARGUMENT (NOT_FOUND,
OUT_OF_RANGE where that is the status) with a message naming the item's field as the request's path
(`items[3].draft_token_ids`), the items beside it answering; a call's own error is the call's status, naming
its field (`release_cache_ids`)."""
from __future__ import annotations

import grpc
import httpx
import pytest

from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_for, start_scheduler_for

INTERNAL = ("sampling.", "stopping.", "max_new_tokens", "min_new_tokens", "messages.messages", "/tmp", "/home",
            "/work", "site-packages")
LONG = "x" * 10_000
CHAT = [{"role": "user", "content": "hi"}]
BAD_CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                  "function": {"name": "no spaces!", "arguments": "{}"}}]}

# (route, body, the param named)
HTTP_CASES = [
    ("chat", {"messages": CHAT, "top_p": 2}, "top_p"),
    ("chat", {"messages": CHAT, "temperature": -1}, "temperature"),
    ("chat", {"messages": CHAT, "min_p": 2}, "min_p"),
    ("chat", {"messages": CHAT, "presence_penalty": 5}, "presence_penalty"),
    ("chat", {"messages": CHAT, "frequency_penalty": -5}, "frequency_penalty"),
    ("chat", {"messages": CHAT, "repetition_penalty": -1}, "repetition_penalty"),
    ("chat", {"messages": CHAT, "logit_bias": {"999999": 1}}, "logit_bias"),
    ("chat", {"messages": CHAT, "logit_bias": {"1": 500}}, "logit_bias"),
    ("chat", {"messages": CHAT, "max_completion_tokens": 1_000_000}, "max_completion_tokens"),
    ("chat", {"messages": CHAT, "max_tokens": 1_000_000}, "max_tokens"),
    ("completions", {"prompt": "a b", "max_tokens": 1_000_000}, "max_tokens"),
    ("chat", {"messages": CHAT, "stop": [LONG] * 5}, "stop.0"),
    ("chat", {"messages": CHAT, "stop": ["a"] * 17}, "stop"),
    ("chat", {"messages": CHAT, "max_tokens": 4, "min_tokens": 8}, "min_tokens"),
    ("chat", {"messages": CHAT, "stop_token_ids": [99_999_999]}, "stop_token_ids"),
    ("completions", {"prompt": [999_999], "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": "", "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": "a", "max_tokens": 4, "logprobs": 50}, "logprobs"),
    ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat", {"messages": CHAT, "prompt_logprobs": 50}, "prompt_logprobs"),
    ("chat", {"messages": CHAT, "cache_salt": "s" * 300}, "cache_salt"),
    ("chat", {"messages": CHAT, "guided_json": "{not json"}, "guided_json"),
    ("chat", {"messages": CHAT, "guided_regex": ""}, "guided_regex"),
    ("chat", {"messages": CHAT, "guided_choice": []}, "guided_choice"),
    ("chat", {"messages": [CHAT[0], BAD_CALL, {"role": "user", "content": "x"}]},
     "messages.1.tool_calls.0.function.name"),
    ("chat", {"messages": CHAT, "tool_choice": "none",
              "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ("tokenize", {"prompt": ""}, "prompt"),
    ("tokenize", {"messages": []}, "messages"),
    ("tokenize", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name"),
    ("tokenize", {"messages": [CHAT[0], BAD_CALL]}, "messages.1.tool_calls.0.function.name"),
    ("responses", {"input": "hi", "top_p": 2}, "top_p"),
    ("responses", {"input": "hi", "temperature": -1}, "temperature"),
    ("responses", {"input": "hi", "max_output_tokens": 1_000_000}, "max_output_tokens"),
    ("responses", {"input": "hi", "tool_choice": "none", "tools": [{"type": "function", "name": "bad name"}]},
     "tools.0.name"),
]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "tokenize": "/tokenize",
         "responses": "/v1/responses"}

# (GenerateRequest, status, the field path named)
IDS = pb.TokenIds(ids=[1, 5, 9])
GRPC_CASES = [
    (pb.GenerateRequest(token_ids=IDS, sampling=cpb.SamplingParams(top_p=2)), "INVALID_ARGUMENT", "sampling.top_p"),
    (pb.GenerateRequest(token_ids=IDS, sampling=cpb.SamplingParams(temperature=-1)), "INVALID_ARGUMENT",
     "sampling.temperature"),
    (pb.GenerateRequest(token_ids=IDS, sampling=cpb.SamplingParams(logit_bias={999_999: 1})), "INVALID_ARGUMENT",
     "sampling.logit_bias"),
    (pb.GenerateRequest(token_ids=IDS, stopping=pb.StoppingCriteria(max_new_tokens=1_000_000)), "OUT_OF_RANGE",
     "stopping.max_new_tokens"),
    (pb.GenerateRequest(token_ids=IDS, stopping=pb.StoppingCriteria(max_new_tokens=4, min_new_tokens=8)),
     "INVALID_ARGUMENT", "stopping.min_new_tokens"),
    (pb.GenerateRequest(token_ids=IDS, stopping=pb.StoppingCriteria(stop=["ok", LONG])), "INVALID_ARGUMENT",
     "stopping.stop[1]"),
    (pb.GenerateRequest(token_ids=IDS, stopping=pb.StoppingCriteria(stop_token_ids=[99_999_999])),
     "INVALID_ARGUMENT", "stopping.stop_token_ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[999_999])), "INVALID_ARGUMENT", "token_ids"),
    (pb.GenerateRequest(text=""), "INVALID_ARGUMENT", "text"),
    (pb.GenerateRequest(), "INVALID_ARGUMENT", "input"),
    (pb.GenerateRequest(token_ids=IDS, top_logprobs=50), "INVALID_ARGUMENT", "top_logprobs"),
    (pb.GenerateRequest(token_ids=IDS, prompt_logprobs=50), "INVALID_ARGUMENT", "prompt_logprobs"),
    (pb.GenerateRequest(token_ids=IDS, cache_salt="s" * 300), "INVALID_ARGUMENT", "cache_salt"),
    (pb.GenerateRequest(token_ids=IDS, request_id="r" * 300), "INVALID_ARGUMENT", "request_id"),
    (pb.GenerateRequest(token_ids=IDS, constraint=pb.Constraint()), "INVALID_ARGUMENT", "constraint"),
    (pb.GenerateRequest(token_ids=IDS, constraint=pb.Constraint(regex="")), "INVALID_ARGUMENT", "constraint"),
    (pb.GenerateRequest(messages=pb.ChatMessages()), "INVALID_ARGUMENT", "messages.messages"),
    (pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")],
                                                 tools=[pb.Tool(name="bad name")])),
     "INVALID_ARGUMENT", "messages.tools[0].name"),
]


@pytest.fixture(scope="module")
def executor(request, tiny_checkpoint):
    return start_for(request, tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def scheduler(request, executor):
    return start_scheduler_for(request, executor.address, "--http-port", "0", "--speculative", "off")


def clean(message: str) -> None:
    for word in INTERNAL:
        assert word not in message, f"{word!r} in {message!r}"


@pytest.mark.parametrize("route,body,param", HTTP_CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(HTTP_CASES)])
def test_every_http_400_names_its_param(scheduler, route, body, param):
    r = httpx.post(scheduler.process.http_url + PATHS[route], json={"model": "", **body} if route != "tokenize"
                   else body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert param.split(".")[0] in error["message"], error
    assert error["type"] == "invalid_request_error"
    clean(error["message"])


@pytest.mark.parametrize("message,code,field", GRPC_CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(GRPC_CASES)])
def test_every_grpc_invalid_argument_names_its_field(scheduler, message, code, field):
    with pytest.raises(grpc.RpcError) as failed:
        list(scheduler.stub.Generate(message, timeout=30))
    assert failed.value.code().name == code, failed.value.details()
    details = failed.value.details()
    assert field in details, details
    for path in ("/tmp", "/home", "/work", "site-packages"):
        assert path not in details, details


# The executor: (item, status, its field within the item) of one UnifiedDecode whose item 0 is good.
VOCAB = 448  # the tiny checkpoint's
MASK_BYTES = 4 * ((VOCAB + 31) // 32)
U = epb.UnifiedItem
UNIFIED_CASES = [
    (U(token_ids=[], is_final_chunk=True), "INVALID_ARGUMENT", "token_ids"),
    (U(token_ids=[3, VOCAB], is_final_chunk=True), "INVALID_ARGUMENT", "token_ids"),
    (U(token_ids=[3] * 300, is_final_chunk=True), "OUT_OF_RANGE", "token_ids"),  # past the model's 256
    (U(token_ids=[3], is_final_chunk=True, sampling=cpb.SamplingParams(top_p=2)), "INVALID_ARGUMENT",
     "sampling.top_p"),
    (U(token_ids=[3], is_final_chunk=True, sampling=cpb.SamplingParams(temperature=-1)), "INVALID_ARGUMENT",
     "sampling.temperature"),
    (U(token_ids=[3], is_final_chunk=True, sampling=cpb.SamplingParams(logit_bias={VOCAB: 1})), "INVALID_ARGUMENT",
     "sampling.logit_bias"),
    (U(token_ids=[3], is_final_chunk=True, output=epb.OutputOptions(mode=7)), "INVALID_ARGUMENT", "output.mode"),
    (U(token_ids=[3], is_final_chunk=True, output=epb.OutputOptions(logits_dtype=9)), "INVALID_ARGUMENT",
     "output.logits_dtype"),
    (U(token_ids=[3], is_final_chunk=True, output=epb.OutputOptions(top_logprobs=50)), "INVALID_ARGUMENT",
     "output.top_logprobs"),
    (U(token_ids=[3], is_final_chunk=True, adapter="nope"), "NOT_FOUND", "adapter"),
    (U(token_ids=[3], pos_offset=5, is_final_chunk=True), "INVALID_ARGUMENT", "pos_offset"),
    (U(token_ids=[3], is_final_chunk=True, prompt_len=9), "INVALID_ARGUMENT", "prompt_len"),
    (U(token_ids=[3], is_final_chunk=True, prompt_logprobs=50), "INVALID_ARGUMENT", "prompt_logprobs"),
    (U(token_ids=[3], is_final_chunk=True, prompt_logprobs=1, draft_token_ids=[4]), "INVALID_ARGUMENT",
     "prompt_logprobs"),
    (U(token_ids=[3], is_final_chunk=False, draft_token_ids=[4]), "INVALID_ARGUMENT", "draft_token_ids"),
    (U(token_ids=[3], is_final_chunk=True, draft_token_ids=[4] * 33), "INVALID_ARGUMENT", "draft_token_ids"),
    (U(token_ids=[3], is_final_chunk=True, draft_token_ids=[VOCAB]), "INVALID_ARGUMENT", "draft_token_ids"),
    (U(token_ids=[3], is_final_chunk=True, draft_token_ids=[4],
       output=epb.OutputOptions(mode=epb.OUTPUT_MODE_LOGITS)), "INVALID_ARGUMENT", "output.mode"),
    (U(token_ids=[3], is_final_chunk=False, allowed_tokens=b"\xff" * MASK_BYTES), "INVALID_ARGUMENT",
     "allowed_tokens"),
    (U(token_ids=[3], is_final_chunk=True, allowed_tokens=b"\xff" * 3), "INVALID_ARGUMENT", "allowed_tokens"),
    (U(token_ids=[3], is_final_chunk=True, allowed_tokens=bytes(MASK_BYTES)), "INVALID_ARGUMENT", "allowed_tokens"),
    (U(token_ids=[3], is_final_chunk=True, pooling=epb.PoolingOptions(task=9)), "INVALID_ARGUMENT", "pooling.task"),
]


def _code(number: int) -> str:
    return next(c.name for c in grpc.StatusCode if c.value[0] == number)


def _clean_executor(message: str) -> None:
    for path in ("/tmp", "/home", "/work", "site-packages"):
        assert path not in message, message


def test_every_executor_item_error_names_its_field_by_the_items_index(executor):
    stub = executor.stub
    first = stub.Prefill(epb.PrefillRequest(token_ids=[5, 6, 7]))
    cid, n = first.cache.cache_id, first.cache.seq_len
    items = [U(cache_id=cid, token_ids=[first.output.tokens[0].token_id], pos_offset=n, is_final_chunk=True)]
    items += [case[0] for case in UNIFIED_CASES]
    items.append(U(cache_id=cid, token_ids=[3], pos_offset=n + 1, is_final_chunk=True))  # its cache listed twice
    cases = [(None, "OK", None)] + UNIFIED_CASES + [(None, "INVALID_ARGUMENT", "cache_id")]
    got = stub.UnifiedDecode(epb.UnifiedDecodeRequest(items=items)).results
    wrong = []
    for i, ((_, code, field), result) in enumerate(zip(cases, got)):
        message = result.status.message
        if _code(result.status.code) != code or (field and not message.startswith(f"item {i}")) \
                or (field and f"items[{i}].{field}" not in message):
            wrong.append((i, code, field, _code(result.status.code), message))
        _clean_executor(message)
    assert not wrong, "\n".join(map(str, wrong))
    made = [r.cache.cache_id for r in got if r.cache.cache_id]
    stub.ReleaseCache(epb.ReleaseCacheRequest(cache_ids=made))


def test_decode_and_create_cache_items_name_their_field(executor):
    stub = executor.stub
    first = stub.Prefill(epb.PrefillRequest(token_ids=[5, 6, 7]))
    ref, token = first.cache, first.output.tokens[0].token_id
    D = epb.DecodeItem
    decode = stub.Decode(epb.DecodeRequest(items=[
        D(cache=ref, token_id=token),  # good
        D(token_id=token),
        D(cache=ref, token_id=token, sampling=cpb.SamplingParams(top_p=2)),
        D(cache=ref, token_id=token, output=epb.OutputOptions(mode=7)),
        D(cache=ref, token_id=token, ngram_drafts=epb.NgramDrafts(max_draft_tokens=0, ngram_min=1, ngram_max=2)),
    ])).results
    created = stub.CreateCache(epb.CreateCacheRequest(items=[
        epb.CreateCacheItem(token_ids=[5, 6]),  # good
        epb.CreateCacheItem(token_ids=[5, VOCAB]),
        epb.CreateCacheItem(token_ids=[5], cache_salt="s" * 300),
        epb.CreateCacheItem(token_ids=[5], prompt_logprobs=50),
        epb.CreateCacheItem(token_ids=[5], adapter="nope"),
    ])).results
    want = [(decode, ["OK", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "INVALID_ARGUMENT"],
             [None, "cache.cache_id", "sampling.top_p", "output.mode", "ngram_drafts.max_draft_tokens"]),
            (created, ["OK", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "NOT_FOUND"],
             [None, "token_ids", "cache_salt", "prompt_logprobs", "adapter"])]
    for results, codes, fields in want:
        for i, (result, code, field) in enumerate(zip(results, codes, fields)):
            assert _code(result.status.code) == code, (i, result.status)
            assert field is None or f"items[{i}].{field}" in result.status.message, (i, result.status.message)
            _clean_executor(result.status.message)
    stub.ReleaseCache(epb.ReleaseCacheRequest(cache_ids=[ref.cache_id, created[0].cache.cache_id]))


def test_every_executor_call_error_names_its_field(executor):
    stub = executor.stub
    calls = [
        (lambda: stub.UnifiedDecode(epb.UnifiedDecodeRequest()), "items"),
        (lambda: stub.UnifiedDecode(epb.UnifiedDecodeRequest(items=[U(token_ids=[3], is_final_chunk=True)],
                                                             release_cache_ids=["x"] * 5000)), "release_cache_ids"),
        (lambda: stub.Decode(epb.DecodeRequest(items=[epb.DecodeItem(cache=epb.CacheRef(cache_id="0" * 32),
                                                                     token_id=3)], num_steps=999)), "num_steps"),
        (lambda: stub.CreateCache(epb.CreateCacheRequest()), "items"),
        (lambda: stub.ForwardVerify(epb.ForwardVerifyRequest(token_ids=[3])), "cache.cache_id"),
        (lambda: stub.OpenSession(epb.OpenSessionRequest(client_name="c" * 200)), "client_name"),
        (lambda: stub.CloseSession(epb.CloseSessionRequest()), "session_id"),
        (lambda: stub.LoadAdapter(epb.LoadAdapterRequest(name="bad name", path="x")), "name"),
        (lambda: next(iter(stub.SubscribeKvEvents(epb.SubscribeKvEventsRequest(summary_interval_ms=1)))),
         "summary_interval_ms"),
    ]
    wrong = []
    for call, field in calls:
        try:
            call()
            wrong.append((field, "answered OK"))
        except grpc.RpcError as failed:
            if failed.code() != grpc.StatusCode.INVALID_ARGUMENT or field not in failed.details():
                wrong.append((field, failed.code().name, failed.details()))
            _clean_executor(failed.details())
    assert not wrong, wrong
