"""Reasoning output and the Responses API end to end with the real `openai` client against real processes,
on a tiny Qwen3 checkpoint steered to think (tests/steered_checkpoint.py): after the generation prompt it
writes "<think> every step</think> fish town". The scheduler guesses the qwen3 parser from the family and the
template. Chat: reasoning_content / reasoning whole and streamed, enable_thinking reaching the template,
include_reasoning, structured output on the answer after </think>. /v1/responses: text, instructions,
text.format json_schema, a function-call round trip (function_call_output, previous_response_id), 404 after
the store's eviction and with store false, streamed events in order with sequence numbers, and refusals naming
the field."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.grpc_harness import start_for, start_scheduler_for
from tests.steered_checkpoint import steer

pytestmark = pytest.mark.slow
CHAIN = ["\n", "<think>", " every", " step", "</think>", " fish", " town"]
REASONING, ANSWER = " every step", "fish town"
POINT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
STORE = 2  # --responses-store-size


@pytest.fixture(scope="module")
def url(request, tiny_checkpoint, tmp_path_factory) -> str:
    model = tmp_path_factory.mktemp("steered") / "qwen3-think"
    steer(tiny_checkpoint("qwen3"), model, [CHAIN])
    executor = start_for(request, model, "--kv-blocks", "64")
    scheduler = start_scheduler_for(request, executor.address, "--http-port", "0",
                                    "--responses-store-size", str(STORE))
    return scheduler.process.http_url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, **kw):
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                          **kw)


def test_chat_splits_reasoning_from_the_answer_whole_and_streamed(client):
    message = chat(client).choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (REASONING, REASONING, ANSWER)
    chunks = list(chat(client, stream=True))
    thought = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    said = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (thought, said) == (REASONING, ANSWER)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_enable_thinking_reaches_the_template_and_include_reasoning_drops_it(client):
    off = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (off.reasoning_content, off.content) == (None, " fish town")  # the template closed the block
    hidden = chat(client, extra_body={"include_reasoning": False}).choices[0].message
    assert (hidden.reasoning_content, hidden.content) == (None, ANSWER)


def test_structured_output_applies_to_the_answer_after_the_thinking(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}
    message = chat(client, response_format=fmt, max_tokens=40).choices[0].message
    assert message.reasoning_content == REASONING  # the thinking was free ...
    assert set(json.loads(message.content)) == {"ok"}  # ... the answer follows the schema
    off = chat(client, response_format=fmt, max_tokens=40,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert off.reasoning_content is None and set(json.loads(off.content)) == {"ok"}  # constrained from the start


def test_chat_template_kwargs_cannot_replace_the_servers_variables(url):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.messages"


def respond(client, **kw):
    kw.setdefault("input", "hi")
    kw.setdefault("max_output_tokens", 24)
    return client.responses.create(model="", temperature=0, **kw)


def test_responses_text_instructions_and_reasoning_item(client):
    r = respond(client, instructions="Be terse.")
    assert r.status == "completed" and r.output_text == ANSWER
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == len(CHAIN)  # (the chain after "\n", and EOS)
    plain = respond(client)
    assert plain.usage.input_tokens < r.usage.input_tokens  # the instructions were in the prompt
    cut = respond(client, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_responses_json_schema_format(client):
    r = respond(client, text={"format": {"type": "json_schema", "name": "point", "schema": POINT}}, max_output_tokens=40)
    assert set(json.loads(r.output_text)) == {"ok"}


def test_a_function_call_round_trip(client):
    first = respond(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=150)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, first.output
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    named = respond(client, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                    max_output_tokens=60)
    assert [i.type for i in named.output] == ["reasoning", "function_call"]
    # the result goes back with the stored conversation (previous_response_id) ...
    second = respond(client, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                     input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    # ... or the whole conversation as items, the response's own output sent back
    again = respond(client, input=[{"role": "user", "content": "hi"}, *first.output,
                                   {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert again.output_text == ANSWER
    assert again.usage.input_tokens == second.usage.input_tokens  # the same prompt either way


def test_previous_response_id_is_404_when_evicted_or_not_stored(client):
    unstored = respond(client, store=False)
    with pytest.raises(openai.NotFoundError):
        respond(client, previous_response_id=unstored.id)
    oldest = respond(client)
    for _ in range(STORE):
        respond(client)
    with pytest.raises(openai.NotFoundError) as caught:
        respond(client, previous_response_id=oldest.id)
    assert "--responses-store-size" in caught.value.message


def test_streamed_events_come_in_order(client):
    events = list(client.responses.create(model="", input="hi", temperature=0, max_output_tokens=24, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # runs of deltas as one
    assert squeezed[2:-1] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == ANSWER == events[-1].response.output_text
    with client.responses.stream(model="", input="hi", temperature=0, max_output_tokens=60, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    call = final.output[-1]
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": 5}, "input"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "tools": [WEATHER]}, "tool_choice"),  # "auto", the default with tools
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0.output"),
])
def test_bad_input_is_400_naming_the_field(url, body, param):
    r = httpx.post(f"{url}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
