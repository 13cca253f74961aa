"""The scheduler through the real `grpcurl` binary: the documented commands (README.md, docs/serving.md) work with
reflection alone."""
from __future__ import annotations

import json
import re

import pytest

from tandem.generate.v1 import generate_pb2 as pb
from tests.docs_text import docs_text
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect
from tests.executor.test_grpcurl import GRPCURL, field, grpcurl

SERVICE = "tandem.generate.v1.GenerateService"
pytestmark = pytest.mark.skipif(GRPCURL is None, reason="no grpcurl binary: install the test extra")


@pytest.fixture(scope="module")
def server(request, tiny_checkpoint):
    executor = start_for(request, tiny_checkpoint("llama"), "--kv-blocks", "64")
    return start_scheduler_for(request, executor.address)


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one JSON object per streamed message, back to back."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while at < len(text):
        if text[at].isspace():
            at += 1
            continue
        obj, at = decoder.raw_decode(text, at)
        out.append(obj)
    return out


def test_list_shows_the_services(server):
    services = grpcurl(server, "list").stdout.split()
    assert SERVICE in services and "grpc.health.v1.Health" in services
    methods = grpcurl(server, "list", SERVICE).stdout.split()
    assert {f"{SERVICE}.{m}" for m in ("Generate", "Tokenize", "GetModelInfo")} <= set(methods)


def test_readme_generate_command_streams(server):
    body = {"messages": {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
            "stopping": {"maxNewTokens": 16, "ignoreEos": True}}
    messages = json_stream(grpcurl(server, f"{SERVICE}/Generate", data=body).stdout)
    assert len(messages) >= 2
    last = messages[-1]
    assert field(last, "finish_reason") == "FINISH_REASON_LENGTH"
    assert field(last["usage"], "completion_tokens") == 16
    text = "".join(m.get("text", "") for m in messages)
    same = collect(server.stub, pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Write a haiku about the sea.")]),
        stopping=pb.StoppingCriteria(max_new_tokens=16, ignore_eos=True)))
    assert text == same.text


def test_tokenize_and_model_info(server):
    res = json.loads(grpcurl(server, f"{SERVICE}/Tokenize", data={"text": "hello world"}).stdout)
    assert len(field(res, "token_ids")) == len(res["pieces"]) > 0
    info = json.loads(grpcurl(server, f"{SERVICE}/GetModelInfo", data={}).stdout)
    assert info["architecture"] == "LlamaForCausalLM" and field(info, "max_seq_len") == 256


def test_error_reaches_grpcurl(server):
    out = grpcurl(server, f"{SERVICE}/Generate", data={"text": "hi", "stopping": {"maxNewTokens": 1000}}, check=False)
    assert out.returncode != 0 and "OutOfRange" in out.stderr + out.stdout


def test_readme_constrained_generate_command(server):
    """docs/serving.md "Structured output": a regex constraint through grpcurl (a random model, so only the mask
    makes the text a phone number); the body is the documented command's."""
    body = {"text": "My phone number is", "constraint": {"regex": "[0-9]{3}-[0-9]{4}"},
            "stopping": {"maxNewTokens": 16}}
    assert f"-d '{json.dumps(body)}'" in docs_text("docs/serving.md")
    messages = json_stream(grpcurl(server, f"{SERVICE}/Generate", data=body).stdout)
    text = "".join(m.get("text", "") for m in messages)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
    assert field(messages[-1], "finish_reason") == "FINISH_REASON_STOP"
