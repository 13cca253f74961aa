"""OpenAI tool calling on the chat route. By constraint: `tool_choice` naming a function makes the output that
function's arguments (a JSON object following its `parameters` schema), "required" makes it a JSON array of one
or more calls of the given tools ([{"name": ..., "parameters": {...}}, ...], vLLM's shape), each enforced token by
token by the structured-output engine; the text is then answered as `message.tool_calls` (streamed as
`delta.tool_calls`). "none" only describes the tools to the chat template. "auto" (OpenAI's default when tools
are given) lets the model write text or calls in its own syntax, read by the family's parser
(scheduler/tool_parsers/: --tool-call-parser, or the one the chat template shows); without one it is refused, as
vLLM refuses it without --tool-call-parser.

finish_reason is "tool_calls" when the calls are complete; "length" when max_tokens cut them (the text so far
is then the arguments of a named call, and the message's content for "required", whose array cannot parse).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from scheduler.text.chat_input import check_function_name
from scheduler.tool_parsers.reader import SpecialFilter, ToolCallReader, Update
from scheduler.tool_parsers.registry import SYNTAXES
from scheduler.tool_parsers.syntax import Syntax
from scheduler.http import response_schemas as s
from scheduler.http.request_schemas import ChatCompletionRequest, TokenizeRequest
from scheduler.http.errors import BadParameter
from tandem.errors import InvalidRequest
from tandem.generate.v1 import generate_pb2 as pb

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class AutoTools:
    """tool_choice "auto" on this server: the syntax read, and the tokenizer's special-token texts (a syntax whose
    markers are special tokens needs them kept in the text; the others are then taken out of the content)."""
    syntax: Syntax
    specials: frozenset[str]

    @property
    def keep_special_tokens(self) -> bool:
        return any(m in self.specials for m in self.syntax.markers)


@dataclass(frozen=True)
class ToolMode:
    """How the output is a tool call: of the function `name`, or (name None) one or more of any tool; with auto,
    text or calls in the model's own syntax. max_calls: 1 with parallel_tool_calls false (auto), else None.
    strip: auto reads the text with special tokens taken out (the client did not ask to keep them)."""
    name: str | None
    tools: tuple[str, ...]
    auto: AutoTools | None = None
    max_calls: int | None = None
    strip: bool = True

    def reader(self) -> ToolCallReader:
        """A reader of one choice's output (auto)."""
        auto = self.auto
        strip = SpecialFilter(auto.specials, auto.syntax.markers) if self.strip and auto.keep_special_tokens else None
        return ToolCallReader(auto.syntax, frozenset(self.tools), self.max_calls, strip)


def tools_pb(body: ChatCompletionRequest | TokenizeRequest) -> list[pb.Tool]:
    out = []
    for i, t in enumerate(body.tools or []):
        try:
            check_function_name(t.function.name, f"tools.{i}.function.name")
        except InvalidRequest as exc:
            raise BadParameter(f"tools.{i}.function.name", str(exc)) from None
        params = "" if t.function.parameters is None else json.dumps(t.function.parameters)
        out.append(pb.Tool(name=t.function.name, description=t.function.description or "", parameters=params))
    return out


def tool_mode(body: ChatCompletionRequest, auto: AutoTools | None = None) -> ToolMode | None:
    """The request's tool choice, checked: None when the output is free text. auto: how this server reads the
    model's own calls (None: it does not, and "auto" is refused)."""
    names = tuple(t.function.name for t in body.tools or [])
    choice = body.tool_choice
    if not names:
        if choice not in (None, "none"):
            raise BadParameter("tool_choice", "tool_choice needs tools: give the functions the model may call")
        return None
    if choice is None or choice == "auto":
        if auto is None:
            raise BadParameter("tool_choice", "tool_choice \"auto\" (the default with tools) is not supported by "
                               "this server: the model's chat template shows no tool-call syntax it knows, and the "
                               f"scheduler runs without --tool-call-parser ({', '.join(SYNTAXES)}). Name the "
                               "function (tool_choice={\"type\": \"function\", \"function\": {\"name\": ...}}), "
                               "or send \"required\" (one or more calls of the tools) or \"none\"")
        return ToolMode(None, names, auto, 1 if body.parallel_tool_calls is False else None,
                        strip=body.skip_special_tokens is not False)
    if choice == "none":
        return None
    if choice == "required":
        return ToolMode(None, names)
    if choice.function.name not in names:
        raise BadParameter("tool_choice.function.name", f"tool_choice names {choice.function.name[:70]!r}, which is "
                           f"not among the tools ({', '.join(names)})")
    return ToolMode(choice.function.name, names)


def constraint(body: ChatCompletionRequest, mode: ToolMode) -> pb.Constraint:
    """The JSON Schema the output must follow."""
    params = {t.function.name: t.function.parameters or NO_ARGUMENTS for t in body.tools or []}
    if mode.name is not None:
        return pb.Constraint(json_schema=json.dumps(params[mode.name]))
    call = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
             "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params[name]}}
            for name in mode.tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return pb.Constraint(json_schema=json.dumps(schema))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def calls(mode: ToolMode, text: str) -> list[s.ToolCallOut] | None:
    """The tool calls a finished output makes; None when it does not parse (cut by max_tokens)."""
    if mode.name is not None:
        return [s.ToolCallOut(id=_call_id(), function=s.FunctionCallOut(name=mode.name, arguments=text))]
    try:
        made = json.loads(text)
    except ValueError:
        return None
    if not isinstance(made, list) or not all(isinstance(c, dict) and {"name", "parameters"} <= c.keys()
                                             for c in made):
        return None  # (not the schema's shape: only a cut could make it so)
    return [s.ToolCallOut(id=_call_id(), function=s.FunctionCallOut(name=c["name"],
                                                                    arguments=json.dumps(c["parameters"])))
            for c in made]


class ToolCallStream:
    """One choice's tool calls as stream deltas. A named call streams as its text comes (the first delta
    carries the id and name); "required" calls are sent whole once the array is complete."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.started = False
        self.text = ""

    def delta(self, text: str, finished: bool) -> list[s.ToolCallDelta] | None:
        """The tool-call deltas for this much more text (finished: the output is complete)."""
        self.text += text
        if self.mode.name is not None:
            if not text and self.started:
                return None
            first = not self.started
            self.started = True
            return [s.ToolCallDelta(index=0, id=_call_id() if first else None, type="function" if first else None,
                                    function=s.FunctionCallDelta(name=self.mode.name if first else None,
                                                                 arguments=text))]
        if not finished:
            return None
        made = calls(self.mode, self.text)
        if made is None:
            return None
        return [s.ToolCallDelta(index=i, id=c.id, type="function",
                                function=s.FunctionCallDelta(name=c.function.name, arguments=c.function.arguments))
                for i, c in enumerate(made)]


def auto_delta(update: Update) -> tuple[str | None, list[s.ToolCallDelta] | None]:
    """A reader's update (auto) as a chunk's delta: its content and tool calls (None when empty)."""
    calls = [s.ToolCallDelta(index=d.index, id=d.id, type="function" if d.id else None,
                             function=s.FunctionCallDelta(name=d.name, arguments=d.arguments)) for d in update.calls]
    return update.content or None, calls or None
