"""The HTTP front's pure parts, without a server: OpenAI request bodies -> GenerateRequest protos
(scheduler/http/convert.py), n choices and their seeds, the HTTP status of every domain error's gRPC status,
pydantic error locations -> `param`, usage over several choices."""
from __future__ import annotations

import json

import grpc
import pytest
from pydantic import ValidationError

from scheduler.config import SchedulerConfig
from scheduler.http import convert, errors, render
from scheduler.http.errors import BadParameter
from scheduler.http.limits import HttpLimits
from scheduler.http.request_schemas import ChatCompletionRequest, CompletionRequest
from scheduler.request import GenerateRequest, StoppingCriteria, Usage
from tandem.sampling_params import SamplingParams
from tandem.status_map import STATUS_OF

USER = [{"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def test_sampling_and_stopping_fields_map_onto_the_proto():
    m = convert.chat_request(chat(max_tokens=5, max_completion_tokens=7, stop="x", top_k=-1, top_p=0.9, seed=3,
                                  logit_bias={"12": -100}, min_tokens=2, ignore_eos=True, skip_special_tokens=False,
                                  logprobs=True, top_logprobs=4), adapter="alpha")
    assert m.WhichOneof("input") == "messages" and m.messages.messages[0].content == "hi"
    assert m.stopping.max_new_tokens == 7 and list(m.stopping.stop) == ["x"] and m.stopping.min_new_tokens == 2
    assert m.stopping.ignore_eos and m.keep_special_tokens and m.adapter == "alpha" and m.top_logprobs == 4
    s = m.sampling
    assert (s.temperature, s.top_k, s.seed, dict(s.logit_bias)) == (1.0, 0, 3, {12: -100.0})  # OpenAI's default T
    assert s.top_p == pytest.approx(0.9)
    unset = convert.chat_request(chat(), "")
    assert not unset.sampling.HasField("top_p") and not unset.sampling.HasField("seed")
    assert unset.stopping.max_new_tokens == 0  # the scheduler's --default-max-new-tokens
    assert convert.chat_request(chat(temperature=0), "").sampling.temperature == 0


def test_chat_content_parts_and_refusals():
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert convert.chat_request(parts, "").messages.messages[0].content == "a\nb"
    refusals = [({"tool_choice": "auto"}, "tool_choice"),
                ({"response_format": {"type": "yaml"}}, "response_format"),
                ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                 "response_format.json_schema"),
                ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
                ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                ({"top_logprobs": 2}, "top_logprobs"), ({"logit_bias": {"a": 1}}, "logit_bias"),
                ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0")]
    for fields, param in refusals:
        with pytest.raises(BadParameter) as info:
            convert.chat_request(chat(**fields), "")
        assert info.value.param == param


def test_structured_output_fields_become_the_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [({"response_format": {"type": "json_object"}}, "json_object", None),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema,
                                                                         "strict": True}}}, "json_schema", schema),
             ({"guided_json": schema}, "json_schema", schema), ({"guided_json": '{"type": "string"}'}, "json_schema",
                                                                {"type": "string"}),
             ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"), ({"guided_choice": ["yes", "no"]}, "choice", None),
             ({"guided_grammar": 'start: "a"'}, "grammar", 'start: "a"')]
    for fields, kind, value in cases:
        c = convert.chat_request(chat(**fields), "").constraint
        assert c.WhichOneof("kind") == kind, fields
        if kind == "json_schema":
            assert json.loads(c.json_schema) == value
        elif kind in ("regex", "grammar"):
            assert getattr(c, kind) == value
    assert list(convert.chat_request(chat(guided_choice=["yes", "no"]), "").constraint.choice.choices) == ["yes", "no"]
    for none in ({}, {"response_format": {"type": "text"}}):
        assert not convert.chat_request(chat(**none), "").HasField("constraint")
    (m,) = convert.completion_requests(CompletionRequest.model_validate({"prompt": "a", "guided_regex": "b+"}), "")
    assert m.constraint.regex == "b+"


@pytest.mark.parametrize("prompt, kinds", [("a", ["text"]), (["a", "b"], ["text", "text"]), ([1, 2], ["token_ids"]),
                                           ([[1], [2, 3]], ["token_ids", "token_ids"])])
def test_every_prompt_form_becomes_one_request_each(prompt, kinds):
    ms = convert.completion_requests(CompletionRequest.model_validate({"prompt": prompt}), "")
    assert [m.WhichOneof("input") for m in ms] == kinds


def test_completion_refusals_and_wrong_types():
    for fields, param in [({"max_tokens": 0}, "max_tokens"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"),
                          ({"prompt": []}, "prompt")]:
        with pytest.raises(BadParameter) as info:
            convert.completion_requests(CompletionRequest.model_validate({"prompt": "a", **fields}), "")
        assert info.value.param == param
    assert convert.completion_requests(CompletionRequest.model_validate({"prompt": "a", "best_of": 2, "n": 2}), "")
    for bad in ({"prompt": "a", "temperature": "1"}, {"prompt": "a", "n": 1.0}, {"prompt": [1, -1]},
                {"prompt": "a", "seed": -1}, {"prompt": "a", "stream": "yes"}, {"prompt": "a", "n": 17}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)
    with pytest.raises(ValidationError, match="extra_forbidden"):  # refused (the app names it: 400)
        CompletionRequest.model_validate({"prompt": "a", "unknown_field": 1})
    assert CompletionRequest.model_validate({"prompt": "a", "temperature": None})


def test_n_choices_get_their_own_ids_and_consecutive_seeds():
    base = GenerateRequest("r", (1, 2), StoppingCriteria(4), SamplingParams(temperature=1.0, seed=2**64 - 1))
    out = base.choices(3)
    assert [c.request_id for c in out] == ["r-0", "r-1", "r-2"]
    assert [c.sampling.seed for c in out] == [2**64 - 1, 0, 1]  # wraps within uint64
    assert [c.sampling.seed for c in GenerateRequest("r", (1,), StoppingCriteria(4)).choices(2)] == [None] * 2


def test_every_domain_error_gets_a_client_http_status():
    for code in set(STATUS_OF.values()):
        assert 400 <= errors.HTTP_STATUS_OF[code] < 600, code
    assert errors.HTTP_STATUS_OF[grpc.StatusCode.RESOURCE_EXHAUSTED] == 429
    assert errors.HTTP_STATUS_OF[grpc.StatusCode.UNAVAILABLE] == 503
    assert errors.error_type(404) == "invalid_request_error" and errors.error_type(503) == "server_error"


def test_validation_locations_become_params():
    assert errors.validation_param(("body", "temperature")) == "temperature"
    assert errors.validation_param(("body", "messages", 0, "content", "str")) == "messages.0.content"
    assert errors.validation_param(("body", "prompt", "list[constrained-int]", 1)) == "prompt.1"
    assert errors.validation_param(("body", "messages", 0, "content", "list[ContentPart]", 1, "text")) \
        == "messages.0.content.1.text"
    assert errors.validation_param(("body", "tool_choice", "NamedToolChoice", "function")) == "tool_choice.function"
    assert errors.validation_param(("body", "logit_bias", "12", "[key]")) == "logit_bias"  # stops at a dict key
    assert errors.validation_param(("body",)) is None


def test_usage_counts_each_prompt_once_and_every_choice():
    u = render.usage([Usage(5, 3, 4), Usage(5, 2, 5), Usage(7, 1, 0), Usage(7, 4, 7)], n=2)
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (12, 10, 22)
    assert u.prompt_tokens_details.cached_tokens == 4


@pytest.mark.parametrize("names, says", [(("a", "a"), "given twice"), (("  ",), "not a model name"),
                                         (("x" * 257,), "not a model name"), (("a\nb",), "not a model name")])
def test_served_model_names_are_checked(names, says):
    SchedulerConfig("x:1", served_model_names=("ok", "fine-2")).validate()
    with pytest.raises(ValueError, match=says):
        SchedulerConfig("x:1", served_model_names=names).validate()


@pytest.mark.parametrize("fields, says", [({"header_timeout_s": 0}, "--http-header-timeout-s"),
                                          ({"body_timeout_s": float("nan")}, "--http-body-timeout-s"),
                                          ({"max_connections": 0}, "--http-max-connections"),
                                          ({"max_connections": 8, "max_connections_per_client": 9}, "cannot exceed"),
                                          ({"max_prompts": 0}, "--max-prompts-per-request")])
def test_http_limits_are_checked(fields, says):
    SchedulerConfig("x:1", http_limits=HttpLimits()).validate()
    with pytest.raises(ValueError, match=says):
        SchedulerConfig("x:1", http_limits=HttpLimits(**fields)).validate()


def test_one_validator_refuses_lone_surrogates_in_any_field_however_deep():
    bad = {"messages": [{"role": "user", "content": "hi"}],
           "tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": [{"b": "x\udc00"}]}}}]}
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate(bad)
    (e,) = err.value.errors()
    assert e["loc"] == ("tools", 0, "function", "parameters") and "(at a.0.b)" in e["msg"]
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "héllo \U0001f642 \u202e"}]})
    assert convert.prompts(CompletionRequest.model_validate({"prompt": ["a"] * 3}), max_prompts=3) == ["a"] * 3
    with pytest.raises(BadParameter, match="--max-prompts-per-request"):
        convert.prompts(CompletionRequest.model_validate({"prompt": ["a"] * 4}), max_prompts=3)


def test_image_url_parts_become_image_parts_in_order():
    content = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
               {"type": "text", "text": "b"}]
    m = convert.chat_request(chat(messages=[{"role": "user", "content": content}]), "").messages.messages[0]
    assert not m.content and [p.WhichOneof("part") for p in m.parts] == ["text", "image", "text"]
    assert m.parts[1].image.url == "data:x"
    for bad in ({"url": "data:x", "size": 3}, {"url": "data:x", "detail": "huge"}, {"detail": "auto"}):
        with pytest.raises(BadParameter) as info:
            convert.chat_request(chat(messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": bad}]}]), "")
        assert info.value.param == "messages.0.content.0" and "messages[0].content[0].image_url" in str(info.value)
