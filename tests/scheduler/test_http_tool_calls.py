"""Tool calling on the OpenAI front, in process: tool_choice checked (auto refused, a name not among the tools,
a choice without tools, bad names, another constraint beside it), the JSON Schemas it becomes (named: the
function's parameters; required: an array of calls, one at most without parallel calls), the tools and the
earlier turns' calls carried to the template, and the rendering of outputs as tool_calls, whole and streamed
(named calls as they come, required ones once complete, a cut output as text with finish_reason length)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pydantic import ValidationError

from scheduler.text.chat_input import messages_from_pb, tools_from_pb
from scheduler.http import convert, tool_calls
from scheduler.http.errors import BadParameter
from scheduler.http.render import ChatRenderer
from scheduler.http.request_schemas import ChatCompletionRequest
from scheduler.request import Delta, FinishReason
from tandem.errors import InvalidRequest
from tandem.generate.v1 import generate_pb2 as pb

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
USER = [{"role": "user", "content": "weather in Paris?"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, **kw})


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("fields, param, says", [
    ({}, "tool_choice", '"auto" (the default with tools) is not supported'),
    ({"tool_choice": "auto"}, "tool_choice", "Name the function"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "not among the tools (get_weather, now)"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": NAMED, "guided_regex": "a+"}, "tool_choice", "give only one"),
    ({"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name", "is not a function name"),
])
def test_tool_choice_refusals_name_the_field(fields, param, says):
    with pytest.raises(BadParameter, match=re.escape(says)) as info:
        convert.chat_request(chat(**fields), "")
    assert info.value.param == param


def test_wrong_shapes_are_refused_by_the_schema():
    for bad in ({"tools": [{"type": "function"}]}, {"tools": [{"type": "code", "function": {"name": "a"}}]},
                {"tool_choice": "always"}, {"tool_choice": {"type": "function"}}):
        with pytest.raises(ValidationError):
            chat(**bad)


def test_named_choice_constrains_to_the_parameters_and_required_to_an_array_of_calls():
    named = convert.chat_request(chat(tool_choice=NAMED), "")
    assert json.loads(named.constraint.json_schema) == WEATHER
    assert [t.name for t in named.messages.tools] == ["get_weather", "now"]
    assert json.loads(named.messages.tools[0].parameters) == WEATHER and named.messages.tools[1].parameters == ""
    schema = json.loads(convert.chat_request(chat(tool_choice="required"), "").constraint.json_schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "now", "parameters": {"x": 1}}],
                [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(convert.chat_request(chat(tool_choice="required", parallel_tool_calls=False), "")
                     .constraint.json_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)
    none = convert.chat_request(chat(tool_choice="none"), "")
    assert not none.HasField("constraint") and len(none.messages.tools) == 2  # described, not called


def test_earlier_calls_and_tool_results_reach_the_template():
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    m = convert.chat_request(chat(messages=history, tool_choice="none"), "")
    (call,) = m.messages.messages[1].tool_calls
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert m.messages.messages[2].tool_call_id == "call_1" and m.messages.messages[1].content == ""
    messages = messages_from_pb(m.messages.messages)
    assert messages[1].tool_calls[0].name == "get_weather" and messages[2].tool_call_id == "call_1"


def test_tools_from_pb_checks_what_grpc_clients_send():
    assert tools_from_pb([pb.Tool(name="a", parameters='{"type": "object"}')])[0].parameters == {"type": "object"}
    for tools, says in (([pb.Tool(name="a"), pb.Tool(name="a")], "names an earlier tool"),
                        ([pb.Tool(name="a", parameters="{")], "is not JSON"),
                        ([pb.Tool(name="a", parameters="[]")], "must be a JSON object"),
                        ([pb.Tool(name="")], "is not a function name"),
                        ([pb.Tool(name=f"t{i}") for i in range(129)], "at most 128")):
        with pytest.raises(InvalidRequest, match=says):
            tools_from_pb(tools)
    with pytest.raises(InvalidRequest, match="tool_calls\\[0\\].name"):
        messages_from_pb([pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", name="a b")])])


def renderer(mode, n: int = 1) -> ChatRenderer:
    return ChatRenderer("m", n, n, lambda i, as_ids: str(i), False, False, logprobs=False, tool_mode=mode)


def test_whole_responses_carry_tool_calls():
    named = tool_calls.ToolMode("get_weather", ("get_weather", "now"))
    r = renderer(named)
    r.add(0, Delta(text='{"city": "Paris"}', finish_reason=FinishReason.STOP))
    (choice,) = r.whole().choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and (call.function.name, call.function.arguments) == \
        ("get_weather", '{"city": "Paris"}')
    required = tool_calls.ToolMode(None, ("get_weather", "now"))
    r = renderer(required)
    r.add(0, Delta(text='[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "A"}}]',
                   finish_reason=FinishReason.STOP))
    calls = r.whole().choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("now", {}),
                                                                                    ("get_weather", {"city": "A"})]
    assert len({c.id for c in calls}) == 2
    assert tool_calls.calls(required, '[{"name": "now"}]') is None and tool_calls.calls(required, "7") is None
    cut = renderer(required)
    cut.add(0, Delta(text='[{"name": "no', finish_reason=FinishReason.LENGTH))
    (choice,) = cut.whole().choices
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == \
        ("length", '[{"name": "no', None)


def _chunks(r: ChatRenderer, deltas: list[Delta]) -> list[dict]:
    out = [r.chunk(0, d) for d in deltas]
    return [json.loads(c[len("data: "):])["choices"][0] for c in out if c is not None]


def test_streamed_tool_calls():
    named = tool_calls.ToolMode("get_weather", ("get_weather",))
    got = _chunks(renderer(named), [Delta(text='{"ci'), Delta(text=""), Delta(text='ty": "A"}'),
                                    Delta(text="", finish_reason=FinishReason.STOP)])
    first, second, last = got
    assert first["delta"]["tool_calls"][0]["id"].startswith("call_")
    assert first["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert second["delta"]["tool_calls"][0] == {"index": 0, "id": None, "type": None,
                                                "function": {"name": None, "arguments": 'ty": "A"}'}}
    assert last["finish_reason"] == "tool_calls" and second["finish_reason"] is None
    required = tool_calls.ToolMode(None, ("now",))
    got = _chunks(renderer(required), [Delta(text='[{"name": "now", '), Delta(text='"parameters": {}}]',
                                                                               finish_reason=FinishReason.STOP)])
    (whole,) = got  # held until the array closes, then whole
    assert whole["delta"]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    assert whole["finish_reason"] == "tool_calls"
    cut = _chunks(renderer(required), [Delta(text='[{"na'), Delta(text="", finish_reason=FinishReason.LENGTH)])
    assert [(c["delta"]["content"], c["finish_reason"]) for c in cut] == [('[{"na', "length")]
