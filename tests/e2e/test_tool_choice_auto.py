"""tool_choice "auto" end to end: real executor (tiny Qwen2) and schedulers, the official `openai` client and
langchain-openai's `bind_tools`, with a Qwen2.5-style chat template (tests/tool_templates.py): the scheduler
recognises its Hermes syntax, the model's text is read for calls by the real parser. The tiny random model only
writes a call when told to: its output is steered by vLLM's guided_regex (structured output shapes the text, the
parser then reads it, as vLLM serves guided_* beside "auto"). Covered: tools without tool_choice, whole and
streamed (OpenAI's delta shape), parallel calls, parallel_tool_calls false, text before a call, an answer with no
call, a call that names no tool (content), the next turn with the call and its result rendered by the template,
--tool-call-parser choosing another syntax, and "auto" refused (400 naming the flag) where no syntax is known.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import wait_kv_free
from tests.tool_templates import HERMES_TEMPLATE

pytestmark = pytest.mark.slow
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
PARIS = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
CET = r'<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "CET"\}\}\n</tool_call>'
NAME = "tiny-qwen"


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    """A tiny random Qwen2 with room for the tools' system prompt (the default tiny model takes 256 tokens)."""
    return tiny_checkpoint("qwen2", config_overrides={"max_position_embeddings": 2048})


@pytest.fixture(scope="module")
def stack(request, model_dir, tmp_path_factory):
    """(executor, scheduler reading Hermes calls, scheduler told --tool-call-parser llama3_json, scheduler whose
    template shows no tool syntax)."""
    template = tmp_path_factory.mktemp("template") / "qwen.jinja"
    template.write_text(HERMES_TEMPLATE)
    executor = start_for(request, model_dir, "--kv-blocks", "128")
    common = ("--http-port", "0", "--served-model-name", NAME)
    hermes = start_scheduler_for(request, executor.address, *common, "--chat-template", str(template))
    llama = start_scheduler_for(request, executor.address, *common, "--chat-template", str(template),
                                "--tool-call-parser", "llama3_json")
    plain = start_scheduler_for(request, executor.address, *common)
    return executor, hermes, llama, plain


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.process.http_url}/v1", api_key="none", max_retries=0, timeout=120)


def _ask(client, regex: str, **kw):
    return client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=400, temperature=0,
                                          extra_body={"guided_regex": regex}, **kw)


def _gather(chunks) -> tuple[str, list[list[str]], list, str | None]:
    """(content, [[id, name, arguments]], the tool-call deltas, finish_reason) of a chat stream."""
    content, calls, deltas, finish = "", {}, [], None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                deltas.append(d)
                if d.id is not None:
                    calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
                else:
                    calls[d.index][2] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], deltas, finish


def test_tools_without_tool_choice_are_read_from_the_models_text_whole_and_streamed(stack):
    executor, hermes, _, _ = stack
    client = _client(hermes)
    whole = _ask(client, PARIS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    content, calls, deltas, finish = _gather(_ask(client, PARIS, stream=True))
    assert content == "" and finish == "tool_calls"
    assert [c[1:] for c in calls] == [["get_weather", call.function.arguments]]
    first, *rest = deltas
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert rest and all(d.id is None and d.function.name is None and d.function.arguments for d in rest)
    wait_kv_free(executor.stub)


def test_parallel_calls_text_before_them_and_parallel_tool_calls_false(stack):
    _, hermes, _, _ = stack
    client = _client(hermes)
    both = rf"Checking both\.\n\n{PARIS}\n{CET}"
    whole = _ask(client, both).choices[0]
    assert whole.message.content == "Checking both." and whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    content, calls, deltas, finish = _gather(_ask(client, both, stream=True))
    assert content == "Checking both." and finish == "tool_calls"
    assert [c[1:] for c in calls] == [[c.function.name, c.function.arguments] for c in whole.message.tool_calls]
    assert {d.index for d in deltas} == {0, 1} and len({c[0] for c in calls}) == 2
    one = _ask(client, both, parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"]


def test_answers_without_a_call_and_calls_of_no_tool_are_content(stack):
    _, hermes, _, _ = stack
    client = _client(hermes)
    text = _ask(client, r"It is sunny in Paris\.").choices[0]
    assert text.message.content == "It is sunny in Paris." and text.message.tool_calls is None
    assert text.finish_reason == "stop"
    unknown = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    made = _ask(client, r'<tool_call>\n\{"name": "launch", "arguments": \{\}\}\n</tool_call>').choices[0]
    assert made.message.content == unknown and made.message.tool_calls is None and made.finish_reason == "stop"
    streamed = _gather(_ask(client, r'<tool_call>\n\{"name": "launch", "arguments": \{\}\}\n</tool_call>',
                            stream=True))
    assert streamed[:2] == (unknown, []) and streamed[3] == "stop"


def test_the_next_turn_renders_the_call_and_its_result(stack):
    _, hermes, _, _ = stack
    client = _client(hermes)
    call = _ask(client, PARIS).choices[0].message.tool_calls[0]
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    url = hermes.process.http_url
    rendered = httpx.post(f"{url}/tokenize", json={"messages": turn, "tools": TOOLS, "return_token_strs": True},
                          timeout=60).json()
    text = "".join(rendered["token_strs"])
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text and "sunny, 21 C" in text
    answer = client.chat.completions.create(model=NAME, messages=turn, tools=TOOLS, max_tokens=40,
                                            extra_body={"guided_regex": r"Sunny, 21 C\."}).choices[0]
    assert answer.message.content == "Sunny, 21 C." and answer.message.tool_calls is None


def test_the_flag_chooses_the_syntax_and_auto_is_refused_without_one(stack):
    _, _, llama, plain = stack
    made = _ask(_client(llama), r'\{"name": "get_time", "parameters": \{"tz": "CET"\}\}').choices[0]
    assert [(c.function.name, c.function.arguments) for c in made.message.tool_calls] == [("get_time",
                                                                                          '{"tz": "CET"}')]
    assert "reads the llama3_json syntax (--tool-call-parser)" in llama.stderr()
    with pytest.raises(openai.BadRequestError) as info:
        _client(plain).chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=4)
    assert info.value.body["param"] == "tool_choice" and "--tool-call-parser" in info.value.body["message"]


def test_langchain_bind_tools(stack):
    """langchain-openai's ChatOpenAI(...).bind_tools([...]): tool_choice left unset, as agents send it."""
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        return "sunny"

    _, hermes, _, _ = stack
    llm = ChatOpenAI(model=NAME, base_url=f"{hermes.process.http_url}/v1", api_key="none", temperature=0,
                     max_retries=0, max_tokens=400, extra_body={"guided_regex": PARIS})
    bound = llm.bind_tools([get_weather])
    message = bound.invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert message.response_metadata["finish_reason"] == "tool_calls"
    gathered = None
    for chunk in bound.stream("What is the weather in Paris?"):
        gathered = chunk if gathered is None else gathered + chunk
    assert [(c["name"], c["args"]) for c in gathered.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_responses_with_tools_and_no_tool_choice_is_auto(stack):
    """/v1/responses: tools without tool_choice means "auto" there too — answered through the same parser (the
    tiny model's free text comes back as a message), and refused naming the flag where no parser is known."""
    _, hermes, _, plain = stack
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    got = _client(hermes).responses.create(model=NAME, input="What is the weather in Paris?", tools=tools,
                                           max_output_tokens=12, temperature=0)
    assert got.status in ("completed", "incomplete") and got.output
    assert {item.type for item in got.output} <= {"message", "function_call"}
    with pytest.raises(openai.BadRequestError) as refused:
        _client(plain).responses.create(model=NAME, input="What is the weather in Paris?", tools=tools,
                                        max_output_tokens=12)
    assert refused.value.body["param"] == "tool_choice" and "--tool-call-parser" in refused.value.body["message"]


def test_langchain_with_structured_output(stack):
    """langchain-openai's with_structured_output (its default method: response_format json_schema, strict): the
    answer is constrained to the schema and comes back parsed."""
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    schema = {"title": "Weather", "description": "A city's weather.", "type": "object",
              "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    _, hermes, _, _ = stack
    llm = ChatOpenAI(model=NAME, base_url=f"{hermes.process.http_url}/v1", api_key="none", temperature=0,
                     max_retries=0, max_tokens=60)
    got = llm.with_structured_output(schema).invoke("What is the weather in Paris?")
    assert set(got) == {"city", "sunny"} and isinstance(got["city"], str) and isinstance(got["sunny"], bool)
