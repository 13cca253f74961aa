"""A /v1/responses request -> the chat completion request it means, so that it runs the chat route's very path
(convert.py, tool_calls.py, the reasoning split, ChatRenderer) and generates what a chat request would:

- messages: `instructions` as a system message (never carried over to the next response, as OpenAI says),
  then the conversation of previous_response_id (its input and output, store.py), then `input`:
  text as a user message; message items by role (input_image parts become image_url parts) ("developer" is the template's "system"); function_call items
  as the assistant's tool_calls (consecutive ones are one turn); function_call_output items as "tool" messages;
  reasoning items are dropped (templates drop earlier turns' thinking).
- tools (the flat {"type": "function", "name", ...} shape) and tool_choice ("required" and a named function:
  constrained calls, tool_calls.py; "auto", the default with tools: auto_tool_choice below).
- text.format -> response_format; max_output_tokens -> max_completion_tokens; temperature, top_p.
- reasoning.effort -> the chat template's reasoning_effort variable (gpt-oss templates read it; a template that
  does not use it ignores it: this server has no other way to bound thinking); reasoning.summary: the reasoning
  item carries the parser's whole reasoning text as content, no separate summary is written.

A refusal raised on the chat path names the Responses field (param_of).
"""
from __future__ import annotations

import re

from scheduler.http.errors import BadParameter
from scheduler.http.request_schemas import (ChatCompletionRequest, ChatMessageIn, ContentPart, FunctionCallIn,
                                             FunctionIn, FunctionName, JsonSchemaFormat, NamedToolChoice,
                                             ResponseFormat, ToolCallIn, ToolIn)
from scheduler.http.responses.schemas import (FunctionCallItem, FunctionCallOutputItem, InputImage, MessageItem,
                                              ReasoningItem, ResponsesRequest)

_ROLE = {"developer": "system"}
_RENAMED = [(re.compile(r"^response_format"), "text.format"), (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
            (re.compile(r"^messages(\.\d+)?"), "input"), (re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."),
            (re.compile(r"^tool_choice\.function\."), "tool_choice."), (re.compile(r"^chat_template_kwargs\.reasoning_effort"),
                                                                         "reasoning.effort")]


def param_of(chat_param: str | None) -> str | None:
    """The Responses field of a chat request's field (a refusal raised on the chat path)."""
    if chat_param is None:
        return None
    for pattern, name in _RENAMED:
        if pattern.search(chat_param):
            return pattern.sub(name, chat_param, count=1)
    return chat_param


def auto_tool_choice(body: ResponsesRequest) -> str:
    """tool_choice "auto" (OpenAI's default when tools are given): the model writes text or calls in its own syntax,
    which the chat path's per-family tool-call parser reads (scheduler/tool_parsers/; a server without one for
    its model refuses it there, naming --tool-call-parser)."""
    return "auto"


def input_messages(body: ResponsesRequest) -> list[ChatMessageIn]:
    """The request's input as chat messages (without instructions)."""
    if isinstance(body.input, str):
        return [ChatMessageIn(role="user", content=body.input)]
    out: list[ChatMessageIn] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            out.append(ChatMessageIn(role=_ROLE.get(item.role, item.role), content=_content(item)))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallIn(id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)  # (a turn of parallel calls)
            else:
                out.append(ChatMessageIn(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessageIn(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            assert isinstance(item, ReasoningItem)  # (not shown to the template)
    return out


def _content(item: MessageItem) -> str | list[ContentPart]:
    """The text, or (with input_image parts) the parts in order, as a chat message's content."""
    if isinstance(item.content, str):
        return item.content
    if not any(isinstance(p, InputImage) for p in item.content):
        return "\n".join(p.text for p in item.content)
    parts = []
    for p in item.content:
        if isinstance(p, InputImage):
            if p.image_url is None:
                raise BadParameter("input", "an input_image part needs image_url (file_id is not served)")
            parts.append(ContentPart(type="image_url", image_url={"url": p.image_url}))
        else:
            parts.append(ContentPart(type="text", text=p.text))
    return parts


def _tool_choice(body: ResponsesRequest) -> str | NamedToolChoice | None:
    choice = body.tool_choice
    if not body.tools:
        return choice if isinstance(choice, str) else None if choice is None else NamedToolChoice(
            type="function", function=FunctionName(name=choice.name))
    if choice is None or choice == "auto":
        return auto_tool_choice(body)
    if isinstance(choice, str):
        return choice
    return NamedToolChoice(type="function", function=FunctionName(name=choice.name))


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise BadParameter("text.format.schema", "text.format of type \"json_schema\" needs schema (the JSON Schema "
                           "the output must follow)")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name=fmt.name, schema=fmt.schema_,
                                                                           strict=fmt.strict))


def chat_body(body: ResponsesRequest, history: list[ChatMessageIn]) -> tuple[ChatCompletionRequest,
                                                                             list[ChatMessageIn]]:
    """(the chat request, the conversation so far without instructions: history, then this input)."""
    conversation = history + input_messages(body)
    if not conversation:
        raise BadParameter("input", "input is empty: give text or at least one message item")
    system = [ChatMessageIn(role="system", content=body.instructions)] if body.instructions else []
    variables = dict(body.chat_template_kwargs or {})
    if body.reasoning is not None and body.reasoning.effort is not None:
        variables.setdefault("reasoning_effort", body.reasoning.effort)
    tools = [ToolIn(type="function", function=FunctionIn(name=t.name, description=t.description,
                                                         parameters=t.parameters, strict=t.strict))
             for t in body.tools or []]
    chat = ChatCompletionRequest(messages=system + conversation, model=body.model,
                                 max_completion_tokens=body.max_output_tokens, temperature=body.temperature,
                                 top_p=body.top_p, tools=tools or None, tool_choice=_tool_choice(body),
                                 parallel_tool_calls=body.parallel_tool_calls, response_format=_response_format(body),
                                 chat_template_kwargs=variables or None, user=body.user)
    return chat, conversation
