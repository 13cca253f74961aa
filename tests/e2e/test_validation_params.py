"""Every validation error of the scheduler names the field at fault in the caller's terms, with real processes (one
executor + scheduler pair): over HTTP a 400 whose `param` is the OpenAI parameter as the client sent it (`top_p`,
`max_completion_tokens`, `stop.0`, `messages.0.tool_calls.0.name`...) and whose message says it, never an internal
name (`sampling.`, `max_new_tokens`) nor a host path; over gRPC INVALID_ARGUMENT (OUT_OF_RANGE for a length past
the model's) whose message names the tandem.generate.v1 field path. The cases walk the checks of
scheduler/rpc/codec.py, tandem/sampling_params.py, tandem/codec.py, scheduler/text/chat_input.py and
scheduler/structured/grammar.py that a generate request reaches (the HTTP front's own checks name their
`param` where they are raised: scheduler/http/convert.py, the request schemas)."""
from __future__ import annotations

import grpc
import httpx
import pytest

from tandem.common.v1 import common_pb2 as cpb
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
    ("chat", {"messages": [CHAT[0], BAD_CALL, {"role": "user", "content": "x"}]}, "messages.1.tool_calls.0.name"),
    ("chat", {"messages": CHAT, "tool_choice": "none",
              "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
]

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
def scheduler(request, tiny_checkpoint):
    executor = start_for(request, tiny_checkpoint("llama"))
    return start_scheduler_for(request, executor.address, "--http-port", "0", "--speculative", "off")


def clean(message: str) -> None:
    for word in INTERNAL:
        assert word not in message, f"{word!r} in {message!r}"


@pytest.mark.parametrize("route,body,param", HTTP_CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(HTTP_CASES)])
def test_every_http_400_names_its_param(scheduler, route, body, param):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = httpx.post(scheduler.process.http_url + path, json={"model": "", **body}, timeout=30)
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
