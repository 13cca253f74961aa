"""The tool-call parsers of tool_choice "auto" (scheduler/tool_parsers/), in process, on outputs written the way each
family's model writes them (the syntax its published chat template asks for; vLLM 0.10.1.1's parsers read the
same): complete, parallel, after text, not calls, malformed, cut short. Every output is also streamed split at
every character boundary: the content and calls put together from the deltas equal the whole response's, and the
deltas have OpenAI's shape (a call's first delta carries its id and name, later ones fragments of its arguments).
A call that breaks after its name was streamed is the one documented difference (scheduler/tool_parsers/reader.py).
"""
from __future__ import annotations

import json

import pytest

from scheduler.text import tokenizer as tok
from scheduler.text.tokenizer import ChatMessage, Tool, ToolCall, compile_chat_template
from scheduler.tool_parsers import registry
from scheduler.tool_parsers.hermes import Hermes
from scheduler.tool_parsers.llama3_json import Llama3Json
from scheduler.tool_parsers.mistral import Mistral
from scheduler.tool_parsers.openai_harmony import OpenAIHarmony
from scheduler.tool_parsers.reader import SpecialFilter, ToolCallReader
from scheduler.tool_parsers.syntax import Syntax
from tests.tool_templates import HERMES_TEMPLATE

TOOLS = frozenset({"get_weather", "get_time"})
PARIS, CET = ("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')
QWEN_SPECIALS = frozenset({"<|im_end|>", "<|endoftext|>", "<|im_start|>"})  # (<tool_call> is not special there)
MISTRAL_SPECIALS = frozenset({"</s>", "<s>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[INST]", "[/INST]"})
LLAMA_SPECIALS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|begin_of_text|>"})
HARMONY_SPECIALS = frozenset({"<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
                              "<|return|>", "<|endoftext|>"})

# (syntax, the tokenizer's special-token texts, output, content of the whole response, its calls)
CASES = [
    (Hermes(), QWEN_SPECIALS, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
     "<|im_end|>", None, [PARIS]),
    (Hermes(), QWEN_SPECIALS, 'Let me look both up.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
     "</tool_call>", "Let me look both up.", [PARIS, CET]),
    (Hermes(), QWEN_SPECIALS, '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
     None, [PARIS]),  # keys the other way round: the call shows once its name came
    (Hermes(), QWEN_SPECIALS, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None,
     [PARIS]),  # no closing tag: the object is complete
    (Hermes(), QWEN_SPECIALS, "It is sunny in Paris, 21 °C.", "It is sunny in Paris, 21 °C.", []),
    (Hermes(), QWEN_SPECIALS, 'Use <tool_call> tags: <tool_call>{"name": "launch", "arguments": {}}</tool_call>',
     'Use <tool_call> tags: <tool_call>{"name": "launch", "arguments": {}}</tool_call>', []),  # no such tool
    (Hermes(), QWEN_SPECIALS, '<tool_call>\n{"name": "get_weather" "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather" "arguments": {}}\n</tool_call>', []),  # not JSON (seen at the name)
    (Hermes(), QWEN_SPECIALS, '<think>\nThe user wants Paris.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Paris"}}\n</tool_call>', "<think>\nThe user wants Paris.\n</think>", [PARIS]),  # Qwen3
    (Llama3Json(), LLAMA_SPECIALS, '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', None,
     [PARIS]),
    (Llama3Json(), LLAMA_SPECIALS, '<|python_tag|>{"type": "function", "name": "get_weather", "parameters": '
     '{"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "CET"}}<|eom_id|>', None, [PARIS, CET]),
    (Llama3Json(), LLAMA_SPECIALS, '{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
    (Llama3Json(), LLAMA_SPECIALS, '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    (Llama3Json(), LLAMA_SPECIALS, 'The call would be {"name": "get_weather", "parameters": {"city": "Paris"}}',
     'The call would be {"name": "get_weather", "parameters": {"city": "Paris"}}', []),  # calls come first
    (Mistral(), MISTRAL_SPECIALS, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"tz": "CET"}}]</s>', None, [PARIS, CET]),
    (Mistral(), MISTRAL_SPECIALS, 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time'
     '[ARGS]{"tz": "CET"}</s>', "Checking.", [PARIS, CET]),
    (Mistral(), MISTRAL_SPECIALS, "Paris is sunny.</s>", "Paris is sunny.", []),
    (Mistral(), MISTRAL_SPECIALS, '[TOOL_CALLS]get_stock[ARGS]{"s": "X"}</s>', '[TOOL_CALLS]get_stock[ARGS]{"s": "X"}',
     []),
    (OpenAIHarmony(), HARMONY_SPECIALS, "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>"
     'assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
     "<|call|>", None, [PARIS]),
    (OpenAIHarmony(), HARMONY_SPECIALS, '<|start|>assistant to=functions.get_time<|channel|>commentary json'
     '<|message|>{"tz": "CET"}<|call|>', None, [CET]),
    (OpenAIHarmony(), HARMONY_SPECIALS, "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>"
     "final<|message|>It is sunny.<|return|>", "It is sunny.", []),
]


def _reader(syntax: Syntax, specials: frozenset[str], max_calls: int | None = None) -> ToolCallReader:
    return ToolCallReader(syntax, TOOLS, max_calls, SpecialFilter(specials, syntax.markers))


def _whole(syntax, specials, text, max_calls=None):
    message = _reader(syntax, specials, max_calls).whole(text)
    return message.content, [(c.name, c.arguments) for c in message.calls]


def _streamed(syntax, specials, pieces: list[str], max_calls=None):
    """(content, calls, complete calls) put together from the deltas of text fed in these pieces."""
    reader = _reader(syntax, specials, max_calls)
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        update = reader.feed(piece, final=k == len(pieces) - 1)
        content += update.content
        for d in update.calls:
            if d.id is not None:
                assert d.index == len(calls) and d.name in TOOLS and d.index not in calls
                calls[d.index] = [d.name, d.arguments]
            else:
                assert d.name is None and d.arguments, "a later delta carries only more arguments"
                calls[d.index][1] += d.arguments
    return content or None, [tuple(c) for _, c in sorted(calls.items())], reader.done_calls


@pytest.mark.parametrize("syntax,specials,text,content,calls", CASES,
                         ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_whole_output_and_every_split_of_its_stream_agree(syntax, specials, text, content, calls):
    assert _whole(syntax, specials, text) == (content, calls)
    for a in range(len(text) + 1):
        assert _streamed(syntax, specials, [text[:a], text[a:]]) == (content, calls, len(calls)), a
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # and token-sized pieces, all the way
    assert _streamed(syntax, specials, pieces)[:2] == (content, calls)


@pytest.mark.parametrize("syntax,specials,text", [
    (Hermes(), QWEN_SPECIALS, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    (Llama3Json(), LLAMA_SPECIALS, '{"name": "get_weather", "parameters": {"city": "Pa'),
    (Mistral(), MISTRAL_SPECIALS, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa'),
    (OpenAIHarmony(), HARMONY_SPECIALS, '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Pa'),
])
def test_a_call_cut_short_is_content_whole_and_unfinished_streamed(syntax, specials, text):
    """max_tokens cut the call: the whole response gives its text as content (no call); the stream had sent the
    call's name and arguments so far, never completes it, and every split streams the same."""
    assert _whole(syntax, specials, text) == (text, [])
    results = {repr(_streamed(syntax, specials, [text[:a], text[a:]])) for a in range(len(text) + 1)}
    assert results == {repr((None, [("get_weather", '{"city": "Pa')], 0))}


def test_arguments_that_stop_being_json_after_the_name_break_the_call():
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call> bye'
    assert _whole(Hermes(), QWEN_SPECIALS, text) == (text, [])
    content, calls, done = _streamed(Hermes(), QWEN_SPECIALS, [text])
    assert calls == [("get_weather", '{"city": ')] and done == 0 and content == "Hi\nParis}}</tool_call> bye"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = CASES[1][2]
    assert _whole(Hermes(), QWEN_SPECIALS, text, max_calls=1) == ("Let me look both up.", [PARIS])
    assert _streamed(Hermes(), QWEN_SPECIALS, [text[:60], text[60:]], max_calls=1)[:2] == ("Let me look both up.",
                                                                                          [PARIS])


def test_streamed_deltas_are_shaped_as_openai_streams_them():
    reader = _reader(Hermes(), QWEN_SPECIALS)
    assert reader.feed("Sure. <tool").content == "Sure."  # ("<tool" may begin a call: held)
    first = reader.feed('_call>\n{"name": "get_weather", "arguments": {"ci')
    assert first.content == "" and len(first.calls) == 1
    (d,) = first.calls
    assert d.index == 0 and d.id.startswith("call_") and d.name == "get_weather" and d.arguments == '{"ci'
    (more,) = reader.feed('ty": "Paris"}}\n</tool_call>').calls
    assert more.id is None and more.name is None and more.arguments == 'ty": "Paris"}'
    assert reader.done_calls == 1 and reader.feed("", final=True) == type(first)()


def test_mistral_call_ids_are_nine_letters_and_digits():
    (call,) = _reader(Mistral(), MISTRAL_SPECIALS).whole('[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}').calls
    assert len(call.id) == 9 and call.id.isalnum()


def test_special_tokens_are_kept_when_the_client_asked():
    reader = ToolCallReader(Mistral(), TOOLS)  # (no filter: skip_special_tokens false)
    assert reader.whole("Paris is sunny.</s>").content == "Paris is sunny.</s>"


TEMPLATES = {  # the part of each family's published chat template that shows its syntax
    "hermes": 'return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n'
              '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    "llama3_json": '{{- "Given the following functions, please respond with a JSON for a function call with its '
                   'proper arguments that best answers the given prompt.\\n\\n" }} ... {{- "<|python_tag|>" }}',
    "mistral": '{{- "[TOOL_CALLS][" }}{%- for tool_call in message.tool_calls %}',
    "openai": '{{- "<|start|>assistant<|channel|>" + channel + " to=functions." + name + "<|message|>" }}',
}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_the_syntax_is_chosen_from_the_chat_template_or_the_flag(family):
    assert registry.from_template(TEMPLATES[family]) == family
    assert registry.choose(None, TEMPLATES[family]).name == family
    assert registry.choose("mistral", TEMPLATES[family]).name == "mistral"  # the flag wins
    assert registry.choose("none", TEMPLATES[family]) is None


def test_a_template_without_tools_chooses_nothing():
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert registry.from_template(chatml) is None and registry.choose(None, chatml) is None
    assert registry.choose(None, None) is None
    with pytest.raises(ValueError, match="is not one of"):
        registry.choose("qwen9", chatml)


def test_a_hermes_template_renders_earlier_calls_and_their_results():
    """The agent loop's next turn: an assistant turn's calls and the tool's answer reach a Qwen-style template."""
    template = compile_chat_template(HERMES_TEMPLATE, "test")
    messages = [ChatMessage("user", "Weather in Paris?"),
                ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
                ChatMessage("tool", "sunny", tool_call_id="call_1")]
    text = template.render(messages=[tok._template_message(m) for m in messages],
                           tools=[tok._template_tool(Tool("get_weather", "", {"type": "object"}))],
                           add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert json.loads(text.split("<tools>\n")[1].split("\n</tools>")[0])["function"]["name"] == "get_weather"


def test_long_arguments_are_read_once_however_many_deltas(monkeypatch):
    """Each delta re-reads the text, but a JSON value read before resumes where it stopped (the reader's memo): a
    call of thousands of JSON tokens streamed in token-sized pieces reads each token about once, not once per
    delta (counted: the scanner's steps; without the memo they grow with tokens x deltas, seconds of CPU)."""
    from scheduler.tool_parsers import json_prefix

    steps = 0
    skip = json_prefix.skip_ws

    def counted(text, i):
        nonlocal steps
        steps += 1
        return skip(text, i)

    monkeypatch.setattr(json_prefix, "skip_ws", counted)
    arguments = json.dumps({"rows": [{"k": i, "v": "x"} for i in range(400)]})
    text = f'<tool_call>\n{{"name": "get_time", "arguments": {arguments}}}\n</tool_call>'
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    assert _streamed(Hermes(), QWEN_SPECIALS, pieces) == (None, [("get_time", arguments)], 1)
    tokens = 400 * 10  # ({"k": 1, "v": "x"}: ten tokens each)
    assert steps < 3 * tokens + 2 * len(pieces), steps
