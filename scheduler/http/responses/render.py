"""Chat choices (ChatRenderer: content, reasoning, tool calls) -> OpenAI Responses objects: the whole
`response`, or its SSE stream of typed events, each with its sequence_number:

    response.created, response.in_progress,
    per output item: response.output_item.added,
      reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                 response.content_part.done
      message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
      function_call: response.function_call_arguments.delta..., response.function_call_arguments.done
    response.output_item.done, ..., response.completed (or response.incomplete when max_output_tokens cut it).

Output items: a reasoning item (with --reasoning-parser, when the model thought; its content is the reasoning
text, summary is empty), function_call items (call_id = the chat path's tool call id), a message with one
output_text part. status "incomplete" with incomplete_details.reason "max_output_tokens" when the length limit
ended it. usage: input/output tokens (output_tokens_details.reasoning_tokens is not counted: 0).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from scheduler.http import response_schemas as s
from scheduler.http.render import ChatRenderer
from scheduler.http.request_schemas import ChatMessageIn, FunctionCallIn, ToolCallIn
from scheduler.http.responses.schemas import ResponsesRequest
from scheduler.request import Delta


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Item:
    """One output item being built: reasoning, message or function_call."""

    def __init__(self, kind: str, call_id: str = "", name: str = "") -> None:
        self.kind = kind
        self.id = _id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.text = ""  # reasoning / message text, or a call's arguments
        self.call_id, self.name = call_id, name

    def json(self, status: str) -> dict[str, Any]:
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                    "arguments": self.text, "status": status}
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "status": status,
                    "content": [_text_part("reasoning", self.text)] if status == "completed" else []}
        return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                "content": [_text_part("message", self.text)] if status == "completed" else []}


class ResponsesRenderer:
    def __init__(self, chat: ChatRenderer, body: ResponsesRequest, model: str) -> None:
        self.chat = chat
        self.body = body
        self.model = model
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.sequence = 0
        self.finish: str | None = None

    # ----------------------------------------------------------------- the response object
    def response(self, status: str, usage: s.Usage | None = None) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        choice = b.tool_choice if not hasattr(b.tool_choice, "name") else {"type": "function", "name": b.tool_choice.name}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "output": [i.json("completed") for i in self.items] if status != "in_progress" else [],
            "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None,
                          "summary": b.reasoning.summary if b.reasoning else None},
            "store": b.store is not False, "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt}, "tool_choice": choice or ("auto" if b.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": "disabled", "user": b.user,
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens
                                         if usage.prompt_tokens_details else 0},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def whole(self) -> dict[str, Any]:
        """The response of a finished (not streamed) generation: ChatRenderer.add() took its deltas."""
        completion = self.chat.whole()
        choice = completion.choices[0]
        message = choice.message
        self.finish = choice.finish_reason
        if message.reasoning is not None:
            self._new("reasoning").text = message.reasoning
        for call in message.tool_calls or []:
            self._new("function_call", call.id, call.function.name).text = call.function.arguments
        if message.content is not None or not message.tool_calls:
            self._new("message").text = message.content or ""
        return self.response(self._status(), completion.usage)

    def _new(self, kind: str, call_id: str = "", name: str = "") -> _Item:
        item = _Item(kind, call_id, name)
        self.items.append(item)
        return item

    def conversation_turn(self) -> list[ChatMessageIn]:
        """The output as chat messages, for the next response's previous_response_id."""
        calls = [ToolCallIn(id=i.call_id, function=FunctionCallIn(name=i.name, arguments=i.text))
                 for i in self.items if i.kind == "function_call"]
        text = "".join(i.text for i in self.items if i.kind == "message")
        return [ChatMessageIn(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None)]

    # ----------------------------------------------------------------- the stream
    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def opening(self) -> list[str]:
        started = self.response("in_progress")
        return [self._event("response.created", response=started), self._event("response.in_progress",
                                                                                 response=started)]

    def _where(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item)}

    def _start(self, kind: str, call_id: str = "", name: str = "") -> list[str]:
        out = self._close()
        item = self.open = self._new(kind, call_id, name)
        out.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                               item=item.json("in_progress")))
        if kind != "function_call":
            out.append(self._event("response.content_part.added", **self._where(item), content_index=0,
                                   part=_text_part(kind, "")))
        return out

    def _add(self, kind: str, text: str) -> list[str]:
        out = [] if self.open is not None and self.open.kind == kind and kind != "function_call" else \
            self._start(kind)
        self.open.text += text
        name = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta"}[kind]
        extra = {"logprobs": []} if kind == "message" else {}
        return out + [self._event(name, **self._where(self.open), content_index=0, delta=text, **extra)]

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = self._where(item)
        if item.kind == "function_call":
            out = [self._event("response.function_call_arguments.done", **where, name=item.name,
                               arguments=item.text)]
        else:
            done = "response.reasoning_text.done" if item.kind == "reasoning" else "response.output_text.done"
            extra = {"logprobs": []} if item.kind == "message" else {}
            out = [self._event(done, **where, content_index=0, text=item.text, **extra),
                   self._event("response.content_part.done", **where, content_index=0,
                               part=_text_part(item.kind, item.text))]
        return out + [self._event("response.output_item.done", output_index=where["output_index"],
                                  item=item.json("completed"))]

    def events(self, d: Delta) -> list[str]:
        """The events of one delta of the (only) choice."""
        choice = self.chat.chunk_choice(0, d)
        out: list[str] = []
        if choice is None:
            return out
        delta = choice.delta
        if delta.reasoning_content:
            out += self._add("reasoning", delta.reasoning_content)
        for call in delta.tool_calls or []:
            if call.id is not None:
                out += self._start("function_call", call.id, call.function.name or "")
            if call.function.arguments:
                self.open.text += call.function.arguments
                out.append(self._event("response.function_call_arguments.delta", **self._where(self.open),
                                       delta=call.function.arguments))
        if delta.content:
            out += self._add("message", delta.content)
        if choice.finish_reason is not None:
            self.finish = choice.finish_reason
        return out

    def closing(self) -> list[str]:
        """The events after the last delta: the open item done (an empty message if nothing was said), then
        response.completed / response.incomplete with the whole response."""
        out = self._close()
        if not self.items:
            out += self._start("message") + self._close()
        status = self._status()
        return out + [self._event(f"response.{status}", response=self.response(status, self.chat.usage()))]
