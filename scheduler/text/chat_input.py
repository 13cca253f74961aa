"""A chat input of tandem.generate.v1 (messages, the tool calls of earlier turns, the tools) -> what the chat
template renders, with the checks such an input can fail (INVALID_ARGUMENT naming the field). Tools only
describe functions to the template; making the model call one is a constraint's job (the OpenAI front's
tool_choice, scheduler/http/tool_calls.py)."""
from __future__ import annotations

import json
import re
from typing import Sequence

from scheduler.text.tokenizer import ChatMessage, Tool, ToolCall
from tandem.errors import InvalidRequest
from tandem.generate.v1 import generate_pb2 as pb

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128  # per request
MAX_TOOL_CALLS = 128  # per message
MAX_CALL_ID_CHARS = 256


def chat_chars(chat: pb.ChatMessages) -> int:
    """The characters of a chat input (messages, their tool calls, the tools), for --max-prompt-chars."""
    chars = sum(len(m.role) + len(m.content) + len(m.tool_call_id) + sum(len(p.text) for p in m.parts)
                for m in chat.messages)
    chars += sum(len(c.id) + len(c.name) + len(c.arguments) for m in chat.messages for c in m.tool_calls)
    return chars + sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)


def check_function_name(name: str, field: str) -> None:
    if not FUNCTION_NAME.fullmatch(name):
        raise InvalidRequest(f"{{field}} {name[:70]!r} is not a function name: 1..64 of a-z, A-Z, 0-9, _ and -",
                             field)


def tools_from_pb(tools: Sequence[pb.Tool]) -> tuple[Tool, ...]:
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{{field}} holds {len(tools)} tools; at most {MAX_TOOLS}", "messages.tools")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        check_function_name(t.name, f"messages.tools[{i}].name")
        if any(t.name == o.name for o in out):
            raise InvalidRequest(f"{{field}} {t.name[:70]!r} names an earlier tool too: names must be distinct",
                                 f"messages.tools[{i}].name")
        out.append(Tool(t.name, t.description, parameters_schema(t.parameters, f"messages.tools[{i}].parameters")))
    return tuple(out)


def parameters_schema(text: str, field: str) -> dict | None:
    """A tool's parameters (JSON Schema text) as an object; None when empty."""
    if not text:
        return None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{{field}} is not JSON: {exc}", field) from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{{field}} must be a JSON object (a JSON Schema), got {type(schema).__name__}", field)
    return schema


def messages_from_pb(messages: Sequence[pb.ChatMessage]) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(messages):
        if len(m.tool_calls) > MAX_TOOL_CALLS:
            raise InvalidRequest(f"{{field}} holds {len(m.tool_calls)} tool calls; at most {MAX_TOOL_CALLS}",
                                 f"messages.messages[{i}].tool_calls")
        for j, c in enumerate(m.tool_calls):
            check_function_name(c.name, f"messages.messages[{i}].tool_calls[{j}].name")
            if len(c.id) > MAX_CALL_ID_CHARS:
                raise InvalidRequest(f"{{field}} has {len(c.id)} characters; at most {MAX_CALL_ID_CHARS}",
                                     f"messages.messages[{i}].tool_calls[{j}].id")
        if len(m.tool_call_id) > MAX_CALL_ID_CHARS:
            raise InvalidRequest(f"{{field}} has {len(m.tool_call_id)} characters; at most {MAX_CALL_ID_CHARS}",
                                 f"messages.messages[{i}].tool_call_id")
        out.append(ChatMessage(m.role, _content(i, m), tuple(ToolCall(c.id, c.name, c.arguments)
                                                              for c in m.tool_calls), m.tool_call_id))
    return out


def _content(i: int, m: pb.ChatMessage) -> str | tuple[dict[str, str], ...]:
    """The content as the template reads it: the text, or the parts ({"type": "text"|"image", ...}) in order."""
    if not m.parts:
        return m.content
    if m.content:
        raise InvalidRequest(f"messages[{i}] sets both content and parts: give the text as a part")
    parts = []
    for j, part in enumerate(m.parts):
        kind = part.WhichOneof("part")
        if kind is None:
            raise InvalidRequest(f"messages[{i}].parts[{j}] is empty: set text or image")
        parts.append({"type": "text", "text": part.text} if kind == "text" else {"type": "image"})
    return tuple(parts)


def image_sources(messages: Sequence[pb.ChatMessage], field: str = "parts[{j}].image"
                  ) -> list[tuple[str, str, pb.ImageSource]]:
    """Every image part of the messages in order: (the name an error about it gives, the HTTP front's `param` for
    it, the source). field: the part's name within a message, {j} its index (the HTTP front names its own
    content[{j}].image_url)."""
    return [(f"messages[{i}].{field.format(j=j)}", f"messages.{i}.content.{j}", part.image)
            for i, m in enumerate(messages) for j, part in enumerate(m.parts) if part.WhichOneof("part") == "image"]
