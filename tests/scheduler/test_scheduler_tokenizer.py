"""scheduler.text.tokenizer.ModelTokenizer against transformers' AutoTokenizer loaded from the same directory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tandem.errors import CheckpointError, InvalidRequest, Unsupported
from scheduler.text.tokenizer import ChatMessage, ModelTokenizer, Tool, ToolCall, read_chat_template

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "café, naïve, déjà vu, Ångström, façade",
    "日本語のテキストと中文文本",
    "emoji: 🙂🚀👍🏽 and a family 👨‍👩‍👧",
    "  leading spaces",
    "trailing spaces   ",
    " \t mixed whitespace \t ",
    "line one\nline two\n\nline four\r\n",
    "\n",
    "def add(a, b):\n    return a + b\n",
    "numbers 0 1 2 42 2024 3.14159",
    "<|im_start|>user\nliteral special tokens<|im_end|>",
]

CHATS = {
    "system+user": [ChatMessage("system", "You are terse."), ChatMessage("user", "What is 2+2?")],
    "user-only": [ChatMessage("user", "Hi there! 🙂")],
    "multi-turn": [
        ChatMessage("system", "Answer in French."),
        ChatMessage("user", "Hello"),
        ChatMessage("assistant", "Bonjour !"),
        ChatMessage("user", "How are you?\nTell me more."),
    ],
}


def _as_dicts(messages):
    return [{"role": m.role, "content": m.content} for m in messages]


def _hf_chat_ids(hf, messages) -> list[int]:
    out = hf.apply_chat_template(_as_dicts(messages), add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


@pytest.fixture(scope="module", params=["tiny-llama", "smollm2"])
def model_dir(request, tiny_checkpoint, smollm2_dir) -> Path:
    if request.param == "tiny-llama":
        return tiny_checkpoint("llama")
    return smollm2_dir


@pytest.fixture(scope="module")
def pair(model_dir):
    return ModelTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)


# ------------------------------------------------------------------ encode / decode


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(pair, text):
    ours, hf = pair
    assert ours.encode(text) == hf(text)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(pair, text, skip):
    ours, hf = pair
    ids = hf(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_decode_skips_special_tokens_by_default(pair):
    ours, hf = pair
    ids = _hf_chat_ids(hf, CHATS["user-only"])
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in ours.decode(ids)
    assert "<|im_start|>" in ours.decode(ids, skip_special_tokens=False)


def test_special_ids_and_vocab(pair):
    ours, hf = pair
    assert set(hf.all_special_ids) <= ours.special_ids
    assert ours.vocab_size == len(hf)


def test_pieces_decode_each_token_alone(pair):
    ours, hf = pair
    ids = hf("Hello world\n")["input_ids"]
    assert ours.pieces(ids) == [hf.decode([i], skip_special_tokens=False) for i in ids]


# ------------------------------------------------------------------ chat template


@pytest.mark.parametrize("name", list(CHATS))
def test_encode_chat_matches_apply_chat_template(pair, name):
    ours, hf = pair
    assert ours.encode_chat(CHATS[name]) == _hf_chat_ids(hf, CHATS[name])


@pytest.mark.parametrize("name", list(CHATS))
def test_render_chat_matches_apply_chat_template(pair, name):
    ours, hf = pair
    expected = hf.apply_chat_template(_as_dicts(CHATS[name]), add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(CHATS[name]) == expected


def _copy_tokenizer_files(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


def _set_config_template(d: Path, template: str | None) -> None:
    path = d / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if template is None:
        cfg.pop("chat_template", None)
    else:
        cfg["chat_template"] = template
    path.write_text(json.dumps(cfg))


@pytest.fixture
def tiny_copy(tiny_checkpoint, tmp_path) -> Path:
    return _copy_tokenizer_files(tiny_checkpoint("llama"), tmp_path / "tok")


def test_no_chat_template_is_unsupported(tiny_copy):
    _set_config_template(tiny_copy, None)
    (tiny_copy / "chat_template.jinja").unlink(missing_ok=True)
    tok = ModelTokenizer(tiny_copy)
    assert tok.chat_template is None
    with pytest.raises(Unsupported):
        tok.encode_chat(CHATS["user-only"])
    with pytest.raises(Unsupported):
        tok.render_chat(CHATS["user-only"])
    assert tok.encode("Hello world") == AutoTokenizer.from_pretrained(tiny_copy)("Hello world")["input_ids"]


def test_template_raise_exception_is_invalid_request(tiny_copy):
    _set_config_template(tiny_copy, (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('only user and assistant roles are supported') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"))
    (tiny_copy / "chat_template.jinja").unlink(missing_ok=True)
    tok = ModelTokenizer(tiny_copy)
    assert tok.render_chat([ChatMessage("user", "hi")]) == "user: hi\n"
    with pytest.raises(InvalidRequest, match="only user and assistant"):
        tok.encode_chat([ChatMessage("system", "x"), ChatMessage("user", "hi")])


def test_missing_tokenizer_json_is_checkpoint_error(tiny_copy):
    (tiny_copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        ModelTokenizer(tiny_copy)


def test_corrupt_tokenizer_json_is_checkpoint_error(tiny_copy):
    (tiny_copy / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        ModelTokenizer(tiny_copy)


def test_chat_template_jinja_takes_precedence(tiny_copy):
    _set_config_template(tiny_copy, "{% for m in messages %}CONFIG {{ m['content'] }}{% endfor %}")
    (tiny_copy / "chat_template.jinja").write_text(
        "{% for m in messages %}JINJA {{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %} ->{% endif %}")
    tok = ModelTokenizer(tiny_copy)
    msgs = [ChatMessage("user", "hello")]
    assert tok.render_chat(msgs) == "JINJA hello ->"
    # transformers agrees on which template wins
    hf = AutoTokenizer.from_pretrained(tiny_copy)
    assert tok.render_chat(msgs) == hf.apply_chat_template(_as_dicts(msgs), add_generation_prompt=True,
                                                           tokenize=False)
    assert tok.encode_chat(msgs) == _hf_chat_ids(hf, msgs)


def test_template_sees_special_token_variables(tiny_copy):
    _set_config_template(tiny_copy, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}"
                                    "{% endfor %}")
    (tiny_copy / "chat_template.jinja").unlink(missing_ok=True)
    tok = ModelTokenizer(tiny_copy)
    msgs = [ChatMessage("user", "hi")]
    assert tok.render_chat(msgs) == "<|im_start|>hi<|im_end|>"
    hf = AutoTokenizer.from_pretrained(tiny_copy)
    assert tok.encode_chat(msgs) == _hf_chat_ids(hf, msgs)


def test_chat_template_flag_overrides_the_models_and_gives_one_to_a_model_without(tiny_copy, tmp_path):
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    msgs = [ChatMessage("system", "be brief"), ChatMessage("user", "hi")]
    want = "<system>be brief\n<user>hi\n<assistant>"
    assert ModelTokenizer(tiny_copy, read_chat_template(path)).render_chat(msgs) == want  # over the model's own
    _set_config_template(tiny_copy, None)
    (tiny_copy / "chat_template.jinja").unlink(missing_ok=True)
    tok = ModelTokenizer(tiny_copy, read_chat_template(path))  # a model without one
    assert tok.render_chat(msgs) == want
    hf = AutoTokenizer.from_pretrained(tiny_copy)
    assert tok.encode_chat(msgs) == hf(want, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("content, says", [(None, "cannot read"), ("  \n", "is empty"),
                                           ("{% for m in messages %}", "--chat-template: the chat template does not")])
def test_a_chat_template_file_that_cannot_be_used_names_the_flag(tiny_copy, tmp_path, content, says):
    path = tmp_path / "chat.jinja"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CheckpointError, match=says):
        ModelTokenizer(tiny_copy, read_chat_template(path))


# A template in the shape of Qwen2.5's tool support: the tools listed in the system turn, an assistant turn's
# calls as <tool_call> JSON (arguments written with tojson), tool results as tool turns.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>Tools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n{%- endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}\n<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{%- endfor %}{%- endif %}"
    "{%- if m.tool_call_id %} (for {{ m.tool_call_id }}){%- endif %}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}")


def test_tools_and_tool_calls_render_as_transformers_renders_them(tiny_copy):
    _set_config_template(tiny_copy, TOOLS_TEMPLATE)
    (tiny_copy / "chat_template.jinja").unlink(missing_ok=True)
    tok, hf = ModelTokenizer(tiny_copy), AutoTokenizer.from_pretrained(tiny_copy)
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [Tool("get_weather", "the weather of a city", weather), Tool("now")]
    msgs = [ChatMessage("user", "weather in Paris?"),
            ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
            ChatMessage("tool", "sunny", tool_call_id="call_1")]
    hf_tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                                  "parameters": weather}},
                {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    hf_msgs = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    want = hf.apply_chat_template(hf_msgs, tools=hf_tools, add_generation_prompt=True, tokenize=False)
    got = tok.render_chat(msgs, tools)
    assert got == want and '"arguments": {"city": "Paris"}' in got and "(for call_1)" in got
    assert tok.render_chat(msgs[:1]) == hf.apply_chat_template(hf_msgs[:1], add_generation_prompt=True,
                                                               tokenize=False)  # no tools: none listed
