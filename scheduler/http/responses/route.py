"""POST /v1/responses: OpenAI's Responses API, stateless first, on the chat route's generation path. The body
becomes the chat request it means (convert.py), which is converted, tokenized, constrained and split
(reasoning, tool calls) exactly as a chat completion; ChatRenderer's choice then becomes Responses output
items (render.py), whole or as typed SSE events. A finished response (unless store: false) keeps
its conversation in the bounded store (store.py) for the next request's previous_response_id.

Same rules as the other completion routes: user-scoped tokens (auth.py), per-token shares (one choice), the
client's disconnect aborts the generation, errors with OpenAI's body (errors.py), naming the Responses field.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from scheduler.http import convert, errors, reasoning_output, tool_calls
from scheduler.http.responses import convert as responses_convert
from scheduler.http.errors import BadParameter
from scheduler.http.generation import ClientGone, Generation
from scheduler.fleet.fleet import Fleet
from scheduler.http.render import ChatRenderer, TokenTexts
from scheduler.http.responses.render import ResponsesRenderer
from scheduler.http.responses.schemas import ResponsesRequest
from scheduler.http.responses.store import ResponseStore
from scheduler.reasoning.parser import ReasoningParser
from scheduler.request import GenerateRequest
from scheduler.token_limits import TokenLimits, cost
from tandem.generate.v1 import generate_pb2 as pb
from tandem.security.auth import CURRENT_PRINCIPAL



class Front(Protocol):
    """What the route needs of the app's front (scheduler/http/app.py's _Front: that module installs this one)."""

    fleet: Fleet
    limits: TokenLimits
    reasoning: ReasoningParser | None
    texts: TokenTexts
    auto_tools: tool_calls.AutoTools | None

    async def adapter_for(self, model: str | None) -> str: ...

    async def requests(self, messages: list[pb.GenerateRequest], n: int,
                       template_variables: dict | None = None) -> list[GenerateRequest]: ...

    def model_of(self, requests: list[GenerateRequest]) -> str: ...


def _renamed(fn: Callable, *args):
    """fn(*args), its BadParameter naming the Responses field rather than the chat request's."""
    try:
        return fn(*args)
    except BadParameter as exc:
        raise BadParameter(responses_convert.param_of(exc.param) or exc.param, str(exc)) from None


async def _events(generation: Generation, renderer: ResponsesRenderer,
                  done: Callable[[], None]) -> AsyncIterator[str]:
    """The SSE body. An error after the 200 is one `error` event (OpenAI's shape) that ends the stream."""
    try:
        for line in renderer.opening():
            yield line
        async for _, delta in generation.events():
            for line in renderer.events(delta):
                yield line
        for line in renderer.closing():
            yield line
        done()
    except ClientGone:
        return
    except Exception as exc:  # the status line is sent: the error travels as an event
        error = errors.of_exception(exc)[1]["error"]
        payload = {"type": "error", "sequence_number": renderer.sequence, "code": error["code"],
                   "message": error["message"], "param": error["param"]}
        yield f"event: error\ndata: {json.dumps(payload)}\n\n"
    finally:
        generation.close()


def install(app: FastAPI, front: Front, store: ResponseStore) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        owner = CURRENT_PRINCIPAL.get()
        history = store.conversation(body.previous_response_id, owner) if body.previous_response_id else []
        chat, conversation = _renamed(responses_convert.chat_body, body, history)
        errors.named_as(convert.param_names(chat), responses_convert.param_of)  # the shared checks' errors
        mode = _renamed(tool_calls.tool_mode, chat, front.auto_tools)
        front.fleet.check_overload()  # (before tokenizing: a flood is refused at once, 429 with Retry-After)
        lease = front.limits.enter(owner, 1)
        try:
            adapter = await front.adapter_for(body.model)
            m = _renamed(convert.chat_request, chat, adapter, front.auto_tools)
            if front.reasoning is not None and front.reasoning.keep_special_tokens:
                m.keep_special_tokens = True
            made = await front.requests([m], 1, _renamed(convert.template_variables, chat))
            made, split = reasoning_output.prepare(front.reasoning, made)
            lease.charge(cost(made))
            model = front.model_of(made)
            chat_out = ChatRenderer(model, 1, 1, front.texts, False, True, logprobs=False, tool_mode=mode,
                                    reasoning=split)
            renderer = ResponsesRenderer(chat_out, body, model)
            generation = Generation(front.fleet, made, request.receive, lease)
        except BaseException:
            lease.release()
            raise

        def keep() -> None:
            if body.store is not False:
                store.put(renderer.id, conversation + renderer.conversation_turn(), owner)

        if body.stream:
            try:
                await generation.started()  # refused in the queue: 429 (raised), not a 200 and an error event
            except ClientGone:
                return Response(status_code=499)
            return StreamingResponse(_events(generation, renderer, keep), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async for _, delta in generation.events():
                chat_out.add(0, delta)
        except ClientGone:
            return Response(status_code=499)
        whole = renderer.whole()
        keep()
        return Response(json.dumps(whole), media_type="application/json")
