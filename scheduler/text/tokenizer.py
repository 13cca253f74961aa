"""The model's tokenizer as the scheduler uses it: tokenizer.json via `tokenizers`, the chat template via
jinja2 (rendered the way transformers' `apply_chat_template` does), special-token ids for decoding."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from scheduler.text.gguf_tokenizer import GgufTokenizer
from tandem.errors import CheckpointError, InvalidRequest, Unsupported
from tandem.model_path import is_gguf


@dataclass(frozen=True)
class ToolCall:
    """A call of a tool an assistant turn made (OpenAI's message.tool_calls[i]): arguments as JSON text."""
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Tool:
    """A function the template describes to the model; parameters: its arguments' JSON Schema (None: none)."""
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | tuple[dict[str, str], ...]  # text, or parts ({"type": "text", "text": ...} / {"type": "image"})
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str = ""  # a "tool" turn: the call it answers


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (transformers' / OpenAI's shape); arguments as an object when they
    parse as one (as vLLM passes them: templates write them with tojson)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content if isinstance(m.content, str)
                           else [dict(p) for p in m.content]}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _template_tool(t: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": t.name}
    if t.description:
        function["description"] = t.description
    function["parameters"] = t.parameters if t.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


class _TemplateError(Exception):
    """Raised by a chat template's raise_exception(): the messages do not fit the template."""


def _raise_exception(message: str) -> None:
    raise _TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def compile_chat_template(template: str, where: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it (sandboxed, its filters and globals);
    CheckpointError naming `where` (the flag or the model dir) when it does not compile."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(f"{where}: the chat template does not compile: {exc}") from exc


def read_chat_template(path: Path) -> str:
    """The text of a --chat-template file, compiled once to check it (at startup, before the scheduler waits
    for an executor); CheckpointError naming the flag when it cannot be used."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"--chat-template: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") \
            from None
    if not text.strip():
        raise CheckpointError(f"--chat-template: {path} is empty")
    compile_chat_template(text, "--chat-template")
    return text


class ModelTokenizer:
    """Loads `tokenizer.json` (required), `tokenizer_config.json` and `chat_template.jinja` (optional), or the
    tokenizer and chat template of a GGUF file (model_dir naming a .gguf file: scheduler/text/gguf_tokenizer.py).
    chat_template: a template to use instead of the model's own (--chat-template)."""

    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        self.model_dir = Path(model_dir)
        if is_gguf(self.model_dir):
            gguf = GgufTokenizer(self.model_dir)
            self._tok, config = gguf.tokenizer, gguf.config
        else:
            self._tok = self._load_tokenizer_json(self.model_dir / "tokenizer.json")
            config = self._read_json(self.model_dir / "tokenizer_config.json")
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self._template_vars = {k: _token_text(config.get(k)) for k in
                               ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.chat_template = chat_template or self._find_chat_template(config)
        where = "--chat-template" if chat_template else str(self.model_dir)
        self._compiled = compile_chat_template(self.chat_template, where) if self.chat_template is not None else None

    # ----------------------------------------------------------------- encoding
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text, with the special tokens the tokenizer's post-processor adds (e.g. BOS), as
        transformers' `tokenizer(text)` does (add_special_tokens=False: none). (encode_batch, not encode: only
        it releases the GIL while it runs, so a long text tokenized in a worker thread does not stall the event
        loop.)"""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Token ids of a text pair as the post-processor joins pairs (a cross-encoder's input), as transformers'
        `tokenizer(first, second)` does."""
        return self._tok.encode_batch([(first, second)], add_special_tokens=True)[0].ids

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (as transformers' convert_tokens_to_ids), None if it has none."""
        return self._tok.token_to_id(token)

    def render_chat(self, messages: Sequence[ChatMessage], tools: Sequence[Tool] = (),
                    variables: Mapping[str, Any] | None = None) -> str:
        """The template's text for messages and tools; variables: more of the template's variables (a request's
        chat_template_kwargs, e.g. enable_thinking), which never replace messages, tools or
        add_generation_prompt."""
        if self._compiled is None:
            raise Unsupported(f"model {self.model_dir.name!r} has no chat template (tokenizer_config.json "
                              "chat_template, chat_template.jinja or a GGUF file's tokenizer.chat_template; the "
                              "scheduler's --chat-template gives one); send text or token_ids instead")
        try:
            # (tools=None without tools, as transformers passes it: templates test `if tools`)
            return self._compiled.render({**self._template_vars, **(variables or {}),
                                          "messages": [_template_message(m) for m in messages],
                                          "tools": [_template_tool(t) for t in tools] or None,
                                          "add_generation_prompt": True})
        except _TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected {{field}}: {exc}", "messages.messages") from exc
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the chat template failed on {{field}}: {exc}", "messages.messages") from exc

    def encode_chat(self, messages: Sequence[ChatMessage], tools: Sequence[Tool] = (),
                    variables: Mapping[str, Any] | None = None) -> list[int]:
        """The rendered template's ids. The template writes its own special tokens, so none are added
        (as `apply_chat_template(tokenize=True)` does)."""
        return self._tok.encode_batch([self.render_chat(messages, tools, variables)],
                                      add_special_tokens=False)[0].ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of a rendered prompt (no special tokens added) and each token's character span in it."""
        enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
        return enc.ids, enc.offsets

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of text without the special tokens the post-processor adds (a marker's ids)."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    # ----------------------------------------------------------------- decoding
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (decoded alone; special tokens kept)."""
        return [self._tok.decode([i], skip_special_tokens=False) for i in ids]

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the grammar engine builds its vocabulary from)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # ----------------------------------------------------------------- files
    @staticmethod
    def _load_tokenizer_json(path: Path) -> Tokenizer:
        if not path.is_file():
            raise CheckpointError(f"{path} not found: the scheduler needs the model's tokenizer.json "
                                  "(pass --tokenizer DIR if the executor's model dir is not on this host)")
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses for bad files
            raise CheckpointError(f"{path}: cannot load it with `tokenizers`: {exc}") from exc

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any]:
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read it as JSON: {exc}") from exc

    def _find_chat_template(self, config: dict[str, Any]) -> str | None:
        jinja_file = self.model_dir / "chat_template.jinja"
        if jinja_file.is_file():  # transformers >= 4.43 saves the template here and prefers it
            return jinja_file.read_text()
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return template if isinstance(template, str) and template else None
